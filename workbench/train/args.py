"""TrainingArguments: the Hugging Face names, types, defaults and validation rules.

A plain dataclass, as in transformers, so existing code (``TrainingArguments("out",
learning_rate=3e-4)``, subclasses that add fields) keeps working. Validation happens in
``__post_init__`` and raises :class:`ArgumentError`, a ``ValueError`` whose first word is
the offending field name, so the config loader can point at the right line of a file.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import math
from pathlib import Path
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from workbench.train.edits import learning_rate_problem

__all__ = [
    "ArgumentError",
    "IntervalStrategy",
    "SaveStrategy",
    "SchedulerType",
    "OptimizerNames",
    "TrainingArguments",
    "UNSERVED_FIELDS",
]


class ArgumentError(ValueError):
    """A training argument is invalid; ``key`` names it (None for a combination)."""

    def __init__(self, key: str | None, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.reason = message


class IntervalStrategy(str, enum.Enum):
    NO = "no"
    STEPS = "steps"
    EPOCH = "epoch"


class SaveStrategy(str, enum.Enum):
    NO = "no"
    STEPS = "steps"
    EPOCH = "epoch"
    BEST = "best"


class SchedulerType(str, enum.Enum):
    LINEAR = "linear"
    COSINE = "cosine"
    COSINE_WITH_RESTARTS = "cosine_with_restarts"
    POLYNOMIAL = "polynomial"
    CONSTANT = "constant"
    CONSTANT_WITH_WARMUP = "constant_with_warmup"


class OptimizerNames(str, enum.Enum):
    ADAMW_TORCH = "adamw_torch"
    ADAMW_TORCH_FUSED = "adamw_torch_fused"
    SGD = "sgd"
    ADAFACTOR = "adafactor"


# Fields of HF's TrainingArguments that this build accepts only at their default value,
# with what a user would need instead. Setting one is an error that names the gap.
UNSERVED_FIELDS: dict[str, str] = {
    "push_to_hub": "the Hugging Face Hub is not reachable from workbench; save locally and upload yourself",
    "hub_token": "the Hugging Face Hub is not supported",
    "hub_private_repo": "the Hugging Face Hub is not supported",
    "hub_model_id": "the Hugging Face Hub is not supported",
    "hub_always_push": "the Hugging Face Hub is not supported",
    "hub_revision": "the Hugging Face Hub is not supported",
    "trackio_space_id": "Hugging Face Spaces are not supported; trackio logs to its local store",
    "trackio_bucket_id": "Hugging Face buckets are not supported; trackio logs to its local store",
    "trackio_static_space_id": "Hugging Face Spaces are not supported; trackio logs to its local store",
    "use_liger_kernel": "the liger-kernel package is not part of workbench",
    "liger_kernel_config": "the liger-kernel package is not part of workbench",
    "optim_target_modules": "GaLore/APOLLO optimizers are not supported (optim must be one of "
    + ", ".join(o.value for o in OptimizerNames) + ")",
    "parallelism_config": "parallelism_config (N-D parallelism) is not supported; use fsdp or deepspeed",
    "use_cache": "use_cache is a transformers generation setting; set it on the model config",
    "debug": "debug options (underflow_overflow, tpu_metrics_debug) are not supported",
}

_STEP_FIELDS = ("logging_steps", "eval_steps", "save_steps")
_REPORT_SINKS = ("jsonl", "trackio", "tensorboard")  # "all" means those installed


def _check_steps(name: str, value: float | None) -> None:
    """HF rule for *_steps: a positive int, or a float in (0, 1) meaning a ratio of max_steps."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(name, f"expected an int or a float ratio in (0, 1), got {value!r}")
    if value <= 0:
        raise ArgumentError(name, f"must be > 0, got {value}")
    if value > 1 and float(value) != int(value):
        raise ArgumentError(name, f"values above 1 must be whole numbers of steps, got {value}")


FSDP_SHARDING = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")
FSDP_OPTIONS = (*FSDP_SHARDING, "offload", "auto_wrap")


def _fsdp_options(value: Any) -> list[str]:
    """HF's ``fsdp`` option string ("full_shard auto_wrap") or list, checked, as a list."""
    if value in (None, "", False):
        return []
    if value is True:
        return ["full_shard"]
    words = value.split() if isinstance(value, str) else [str(getattr(v, "value", v)) for v in value]
    unknown = [w for w in words if w not in FSDP_OPTIONS]
    if unknown:
        raise ArgumentError("fsdp", f"unknown option(s) {', '.join(unknown)}; use any of: {', '.join(FSDP_OPTIONS)}")
    if sum(w in FSDP_SHARDING for w in words) > 1:
        raise ArgumentError("fsdp", f"choose one sharding strategy of: {', '.join(FSDP_SHARDING)}")
    return words


def _json_file(name: str, value: Any) -> Any:
    """A path to a JSON file (as HF accepts for fsdp_config / deepspeed) becomes its text."""
    if isinstance(value, str) and value.strip().endswith(".json") and not value.lstrip().startswith("{"):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ArgumentError(name, f"{value}: no such JSON file")
        return path.read_text(encoding="utf-8")
    return value


def _json_or_dict(name: str, value: Any) -> dict | None:
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ArgumentError(name, f"expected a table or a JSON object string ({exc.msg})") from None
        if not isinstance(parsed, dict):
            raise ArgumentError(name, "expected a JSON object")
        return parsed
    raise ArgumentError(name, f"expected a table or a JSON object string, got {type(value).__name__}")


@dataclass
class TrainingArguments:
    """The arguments that shape a training run, with Hugging Face's names and defaults.

    ``output_dir`` is positional as in transformers. Steps-like fields
    (``logging_steps``, ``eval_steps``, ``save_steps``, ``warmup_steps``) accept a float in
    [0, 1) meaning a ratio of the total number of optimizer steps.
    """

    output_dir: str | None = None
    per_device_train_batch_size: int = 8
    num_train_epochs: float = 3.0
    max_steps: int = -1
    learning_rate: float = 5e-5
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict | str | None = None
    warmup_steps: float = 0
    optim: str = "adamw_torch_fused"
    optim_args: str | None = None
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    optim_target_modules: None | str | list[str] = None
    gradient_accumulation_steps: int = 1
    average_tokens_across_devices: bool = True
    max_grad_norm: float = 1.0
    label_smoothing_factor: float = 0.0
    bf16: bool = False
    fp16: bool = False
    bf16_full_eval: bool = False
    fp16_full_eval: bool = False
    tf32: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_kwargs: dict | str | None = None
    gradient_checkpointing: bool | None = None
    gradient_checkpointing_kwargs: dict | str | None = None
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    use_liger_kernel: bool = False
    liger_kernel_config: dict | None = None
    use_cache: bool = False
    neftune_noise_alpha: float | None = None
    torch_empty_cache_steps: int | None = None
    auto_find_batch_size: bool = False
    logging_strategy: str = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    log_on_each_node: bool = True
    logging_nan_inf_filter: bool = True
    include_num_input_tokens_seen: str | bool = "no"
    log_level: str = "passive"
    log_level_replica: str = "warning"
    disable_tqdm: bool | None = None
    report_to: None | str | list[str] = "none"
    run_name: str | None = None
    project: str = "huggingface"
    trackio_space_id: str | None = None
    trackio_bucket_id: str | None = None
    trackio_static_space_id: str | None = None
    eval_strategy: str = "no"
    eval_steps: float | None = None
    eval_delay: float = 0
    per_device_eval_batch_size: int = 8
    prediction_loss_only: bool = False
    eval_on_start: bool = False
    eval_do_concat_batches: bool = True
    eval_use_gather_object: bool = False
    eval_accumulation_steps: int | None = None
    include_for_metrics: list[str] = field(default_factory=list)
    batch_eval_metrics: bool = False
    save_only_model: bool = False
    save_strategy: str = "steps"
    save_steps: float = 500
    save_on_each_node: bool = False
    save_total_limit: int | None = None
    enable_jit_checkpoint: bool = False
    # workbench: copy the state to host memory at the step, write/hash/publish it in the
    # background (one save at a time; train() returns once every checkpoint is published).
    save_async: bool = False
    # workbench: serve a control endpoint (workbench ctl / attach) while train() runs, on rank
    # 0. None means each entry point's default: off for Trainer.train() (as HF), on for
    # `workbench run` and a Session. control_port: TCP instead of a Unix socket (0: any
    # free port; a token is required); control_host: the address it binds (127.0.0.1).
    control: bool | None = None
    control_port: int | None = None
    control_host: str | None = None
    push_to_hub: bool = False
    hub_token: str | None = None
    hub_private_repo: bool | None = None
    hub_model_id: str | None = None
    hub_strategy: str = "every_save"
    hub_always_push: bool = False
    hub_revision: str | None = None
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    ignore_data_skip: bool = False
    restore_callback_states_from_checkpoint: bool = False
    full_determinism: bool = False
    seed: int = 42
    data_seed: int | None = None
    use_cpu: bool = False
    accelerator_config: dict | str | None = None
    parallelism_config: Any | None = None
    dataloader_drop_last: bool = False
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: int | None = None
    dataloader_multiprocessing_context: str | None = None
    dataloader_in_order: bool = True
    remove_unused_columns: bool = True
    label_names: list[str] | None = None
    train_sampling_strategy: str = "random"
    length_column_name: str = "length"
    ddp_find_unused_parameters: bool | None = None
    ddp_bucket_cap_mb: int | None = None
    ddp_broadcast_buffers: bool | None = None
    ddp_static_graph: bool | None = None
    ddp_backend: str | None = None
    ddp_timeout: int = 1800
    fsdp: str | list[str] | None = None
    fsdp_config: dict | str | None = None
    deepspeed: dict | str | None = None
    debug: str | list[str] = ""
    skip_memory_metrics: bool = True
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    resume_from_checkpoint: str | None = None
    local_rank: int = -1

    def __post_init__(self) -> None:
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        self.output_dir = str(self.output_dir)
        if self.run_name is None:
            self.run_name = self.output_dir
        self._reject_unserved()
        self._normalize_enums()
        self._validate_numbers()
        self._validate_control()
        self._validate_eval_and_save()
        self._validate_precision()
        self._validate_dataloader()
        self._normalize_reporting()

    # -- validation pieces -------------------------------------------------------------

    def _reject_unserved(self) -> None:
        defaults = {f.name: f for f in dataclasses.fields(TrainingArguments)}
        for name, why in UNSERVED_FIELDS.items():
            f = defaults[name]
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if getattr(self, name) != default:
                raise ArgumentError(name, f"not supported: {why}")

    def _normalize_enums(self) -> None:
        def pick(name: str, enum_cls: type[enum.Enum]) -> str:
            value = getattr(self, name)
            value = value.value if isinstance(value, enum.Enum) else value
            allowed = [e.value for e in enum_cls]
            if value not in allowed:
                raise ArgumentError(name, f"{value!r} is not one of: {', '.join(allowed)}")
            return value

        self.eval_strategy = pick("eval_strategy", IntervalStrategy)
        self.logging_strategy = pick("logging_strategy", IntervalStrategy)
        self.save_strategy = pick("save_strategy", SaveStrategy)
        self.lr_scheduler_type = pick("lr_scheduler_type", SchedulerType)
        self.optim = pick("optim", OptimizerNames)
        strategies = ("random", "sequential", "group_by_length", "batch_rebalance")
        if self.train_sampling_strategy not in strategies:
            raise ArgumentError(
                "train_sampling_strategy",
                f"{self.train_sampling_strategy!r} is not one of: {', '.join(strategies)}",
            )
        tokens = self.include_num_input_tokens_seen
        if isinstance(tokens, bool):
            tokens = "all" if tokens else "no"
        if tokens not in ("all", "non_padding", "no"):
            raise ArgumentError("include_num_input_tokens_seen", f"{tokens!r} is not one of: all, non_padding, no")
        self.include_num_input_tokens_seen = tokens
        self.lr_scheduler_kwargs = _json_or_dict("lr_scheduler_kwargs", self.lr_scheduler_kwargs) or {}
        self.accelerator_config = _json_or_dict("accelerator_config", self.accelerator_config)
        self.fsdp_config = _json_or_dict("fsdp_config", _json_file("fsdp_config", self.fsdp_config))
        self.deepspeed = _json_or_dict("deepspeed", _json_file("deepspeed", self.deepspeed))
        self.fsdp = _fsdp_options(self.fsdp)
        if self.deepspeed and importlib.util.find_spec("deepspeed") is None:
            raise ArgumentError("deepspeed", "DeepSpeed is not installed (pip install deepspeed), or unset deepspeed")
        if self.fsdp and self.deepspeed:
            raise ArgumentError(None, "fsdp and deepspeed are both set; choose one")
        if self.fsdp_config and not self.fsdp:
            raise ArgumentError("fsdp_config", 'applies only with fsdp set (e.g. fsdp = "full_shard auto_wrap")')
        if self.ddp_backend not in (None, "gloo", "nccl", "mpi", "ccl", "hccl", "cncl", "mccl", "xccl"):
            raise ArgumentError("ddp_backend", f"{self.ddp_backend!r} is not a torch.distributed backend "
                                               "(gloo, nccl, mpi, ccl, hccl, cncl, mccl, xccl)")
        for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
            setattr(self, name, _json_or_dict(name, getattr(self, name)))
        # gradient_checkpointing is HF's older name for activation_checkpointing.
        if self.activation_checkpointing is None:
            self.activation_checkpointing = bool(self.gradient_checkpointing)
        if self.activation_checkpointing_kwargs is None:
            self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs
        if self.disable_tqdm is None:
            self.disable_tqdm = False

    def _validate_control(self) -> None:
        if self.control is not None and not isinstance(self.control, bool):
            raise ArgumentError("control", f"expected true, false or None (the entry point's default), got {self.control!r}")
        port = self.control_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
            raise ArgumentError("control_port", f"expected a TCP port from 0 to 65535 (0: any free port), got {port!r}")
        if self.control_host is not None and port is None:
            raise ArgumentError("control_host", "names the address of a TCP endpoint; set control_port too")

    def _validate_numbers(self) -> None:
        positive_ints = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
        for name in positive_ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(name, f"must be a positive integer, got {value!r}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ArgumentError("max_steps", f"must be a positive integer, or -1 to use num_train_epochs; got {self.max_steps}")
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise ArgumentError("num_train_epochs", f"must be > 0 when max_steps is -1, got {self.num_train_epochs}")
        problem = learning_rate_problem(self.learning_rate)  # the rule live edits follow too
        if problem is not None:
            raise ArgumentError("learning_rate", problem)
        if self.weight_decay < 0:
            raise ArgumentError("weight_decay", f"must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ArgumentError(name, f"must be in [0, 1), got {getattr(self, name)}")
        if self.adam_epsilon <= 0:
            raise ArgumentError("adam_epsilon", f"must be > 0, got {self.adam_epsilon}")
        if self.max_grad_norm < 0:
            raise ArgumentError("max_grad_norm", f"must be >= 0 (0 disables clipping), got {self.max_grad_norm}")
        if not 0 <= self.label_smoothing_factor < 1:
            raise ArgumentError("label_smoothing_factor", f"must be in [0, 1), got {self.label_smoothing_factor}")
        w = self.warmup_steps
        if isinstance(w, bool) or w < 0 or (w >= 1 and float(w) != int(w)):
            raise ArgumentError("warmup_steps", f"must be a whole number of steps or a ratio in [0, 1), got {w}")
        if self.warmup_steps >= 1:
            self.warmup_steps = int(self.warmup_steps)
        for name in _STEP_FIELDS:
            _check_steps(name, getattr(self, name))
            value = getattr(self, name)
            if value is not None and value > 1:
                setattr(self, name, int(value))
        if self.torch_empty_cache_steps is not None and (
            not isinstance(self.torch_empty_cache_steps, int) or self.torch_empty_cache_steps < 1
        ):
            raise ArgumentError("torch_empty_cache_steps", f"must be a positive integer or unset, got {self.torch_empty_cache_steps!r}")
        if self.eval_accumulation_steps is not None and self.eval_accumulation_steps < 1:
            raise ArgumentError("eval_accumulation_steps", f"must be a positive integer or unset, got {self.eval_accumulation_steps}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ArgumentError("save_total_limit", f"must be >= 1 or unset, got {self.save_total_limit}")
        if self.eval_delay < 0:
            raise ArgumentError("eval_delay", f"must be >= 0, got {self.eval_delay}")
        if self.neftune_noise_alpha is not None and self.neftune_noise_alpha <= 0:
            raise ArgumentError("neftune_noise_alpha", f"must be > 0 or unset, got {self.neftune_noise_alpha}")

    def _validate_eval_and_save(self) -> None:
        if self.eval_strategy == "steps" and self.eval_steps is None:
            self.eval_steps = self.logging_steps
        # As HF: "loss" is implied by load_best_model_at_end (and a plateau schedule) only;
        # save_strategy="best" without a metric is the Trainer's ValueError.
        if self.metric_for_best_model is None and (self.load_best_model_at_end
                                                   or self.lr_scheduler_type == "reduce_lr_on_plateau"):
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.save_strategy == "best" and self.eval_strategy == "no":
            raise ArgumentError("save_strategy", '"best" needs evaluations: set eval_strategy to "steps" or "epoch"')
        if self.load_best_model_at_end:
            if self.eval_strategy == "no":
                raise ArgumentError("load_best_model_at_end", 'needs evaluations: set eval_strategy to "steps" or "epoch"')
            if self.save_strategy != "best":
                if self.save_strategy != self.eval_strategy:
                    raise ArgumentError(
                        "load_best_model_at_end",
                        f"requires save_strategy to match eval_strategy (save_strategy={self.save_strategy!r}, "
                        f'eval_strategy={self.eval_strategy!r}), or save_strategy="best"',
                    )
                if self.eval_strategy == "steps" and not _is_multiple(self.save_steps, self.eval_steps):
                    raise ArgumentError(
                        "load_best_model_at_end",
                        f"requires save_steps ({self.save_steps}) to be a multiple of eval_steps ({self.eval_steps})",
                    )
        if self.eval_on_start and self.eval_strategy == "no":
            raise ArgumentError("eval_on_start", 'evaluates before training, so eval_strategy must not be "no"')

    def _validate_precision(self) -> None:
        if self.fp16 and self.bf16:
            raise ArgumentError(None, "fp16 and bf16 are both set: choose one mixed-precision mode")
        if self.fp16_full_eval and self.bf16_full_eval:
            raise ArgumentError(None, "fp16_full_eval and bf16_full_eval are both set: choose one")
        import torch

        on_gpu = not self.use_cpu and torch.cuda.is_available()
        on_mps = not self.use_cpu and torch.backends.mps.is_available()
        if (self.fp16 or self.fp16_full_eval) and not (on_gpu or on_mps):
            name = "fp16" if self.fp16 else "fp16_full_eval"
            raise ArgumentError(name, "fp16 needs a CUDA or MPS device and none is available; use bf16 on the CPU")
        if self.tf32 and not (on_gpu and torch.cuda.get_device_capability()[0] >= 8):
            raise ArgumentError("tf32", "TF32 needs an NVIDIA Ampere (or newer) GPU and this machine has none; unset tf32")

    def _validate_dataloader(self) -> None:
        if self.dataloader_num_workers < 0:
            raise ArgumentError("dataloader_num_workers", f"must be >= 0, got {self.dataloader_num_workers}")
        if self.dataloader_num_workers == 0:
            if self.dataloader_prefetch_factor is not None:
                raise ArgumentError("dataloader_prefetch_factor", "only applies with dataloader_num_workers > 0")
            if self.dataloader_persistent_workers:
                raise ArgumentError("dataloader_persistent_workers", "only applies with dataloader_num_workers > 0")
            if self.dataloader_multiprocessing_context is not None:
                raise ArgumentError("dataloader_multiprocessing_context", "only applies with dataloader_num_workers > 0")
        if self.dataloader_prefetch_factor is not None and self.dataloader_prefetch_factor < 1:
            raise ArgumentError("dataloader_prefetch_factor", f"must be >= 1, got {self.dataloader_prefetch_factor}")
        contexts = ("fork", "spawn", "forkserver")
        if self.dataloader_multiprocessing_context not in (None, *contexts):
            raise ArgumentError("dataloader_multiprocessing_context",
                                f"{self.dataloader_multiprocessing_context!r} is not one of: {', '.join(contexts)}")

    def _normalize_reporting(self) -> None:
        sinks = self.report_to
        if sinks is None:
            sinks = ["none"]
        elif isinstance(sinks, str):
            sinks = [sinks]
        sinks = list(sinks)
        for sink in sinks:
            if sink not in (*_REPORT_SINKS, "all", "none"):
                raise ArgumentError("report_to", f"{sink!r} is not available; choose from: {', '.join((*_REPORT_SINKS, 'all', 'none'))}")
        if "none" in sinks:
            sinks = []
        elif "all" in sinks:
            from workbench.train.tracking import available_sinks

            sinks = available_sinks()
        self.report_to = sinks

    # -- derived values (read-only, as in HF) ------------------------------------------

    @cached_property
    def device(self) -> "torch.device":  # noqa: F821
        """The device this process trains on (CPU when use_cpu or no accelerator)."""
        import torch

        if self.use_cpu:
            return torch.device("cpu")
        if torch.cuda.is_available():
            return torch.device("cuda", max(self.local_rank, 0))
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 1 on a CUDA device, else 0 (no DataParallel here)."""
        return 1 if self.device.type == "cuda" else 0

    @property
    def train_batch_size(self) -> int:
        """Micro-batch size per process for training."""
        return self.per_device_train_batch_size * max(1, self.n_gpu)

    @property
    def eval_batch_size(self) -> int:
        """Batch size per process for evaluation."""
        return self.per_device_eval_batch_size * max(1, self.n_gpu)

    @property
    def should_log(self) -> bool:
        """Whether this process logs (the main process, or every node's with log_on_each_node)."""
        import os

        rank = int(os.environ.get("LOCAL_RANK" if self.log_on_each_node else "RANK", "0"))
        return rank == 0

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warmup steps for a run of ``num_training_steps`` (ratio or absolute)."""
        if self.warmup_steps < 1:
            return math.ceil(num_training_steps * self.warmup_steps)
        return int(self.warmup_steps)

    def to_dict(self) -> dict[str, Any]:
        """The arguments as a JSON-friendly dict (what checkpoints and trackers store)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, enum.Enum):
                value = value.value
            out[f.name] = value
        return out

    def to_json_string(self) -> str:
        """The arguments as indented JSON."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """Like to_dict, with values a tracker accepts (scalars and strings only)."""
        return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in self.to_dict().items()}


def _is_multiple(save_steps: float, eval_steps: float | None) -> bool:
    if eval_steps is None:
        return True
    if save_steps < 1 or eval_steps < 1:
        ratio = save_steps / eval_steps
        return abs(ratio - round(ratio)) < 1e-9 and round(ratio) >= 1
    return int(save_steps) % int(eval_steps) == 0
