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
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from workbench.core.args.accelerator import AcceleratorConfig
from workbench.core.args.values import (  # noqa: F401 - ArgumentError and FSDP_SHARDING are part of this module's API
    FSDP_SHARDING, ArgumentError, check_steps, fsdp_options, is_multiple, json_file, json_or_dict, learning_rate_problem,
    typed_strings,
)
from workbench.core.args.enums import (
    SERVED_SCHEDULES, DebugOption, HubStrategy, IntervalStrategy, OptimizerNames, ParallelMode, SaveStrategy,
    SchedulerType, SERVED_OPTIMIZERS, unserved_optimizer,
)
from workbench.core.args.methods import LOG_LEVELS, ArgumentSetters, ProcessMembers

__all__ = [
    "AcceleratorConfig",
    "ArgumentError",
    "DebugOption",
    "HubStrategy",
    "IntervalStrategy",
    "ParallelMode",
    "SaveStrategy",
    "SchedulerType",
    "OptimizerNames",
    "TrainingArguments",
    "UNSERVED_FIELDS",
]


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
    + ", ".join(SERVED_OPTIMIZERS) + ")",
    "parallelism_config": "parallelism_config (N-D parallelism) is not supported; use fsdp or deepspeed",
    "use_cache": "use_cache is a transformers generation setting; set it on the model config",
}

_STEP_FIELDS = ("logging_steps", "eval_steps", "save_steps")
# Argparse settings HfArgumentParser reads from a field's metadata (as on HF's fields).
_BARE_FLAG = {"nargs": "?", "const": True}
_MP_CONTEXTS = ("fork", "spawn", "forkserver")
_SAMPLING = ("random", "sequential", "group_by_length", "batch_rebalance")
_DDP_BACKENDS = ("gloo", "nccl", "mpi", "ccl", "hccl", "cncl", "mccl", "xccl")
# Fields HF reads a JSON object string into a dict for (a command line gives text).
_DICT_FIELDS = ("lr_scheduler_kwargs", "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs",
                "fsdp_config", "deepspeed", "accelerator_config")
# report_to's sinks and the package each needs (None: built in); "all" means those installed.
REPORT_SINKS: dict[str, str | None] = {"jsonl": None, "trackio": "trackio", "tensorboard": "tensorboard"}


def available_sinks() -> list[str]:
    """Sinks whose package is installed (what report_to="all" means here)."""
    import importlib.util

    return [name for name, package in REPORT_SINKS.items() if package is None or importlib.util.find_spec(package)]


@dataclass
class TrainingArguments(ProcessMembers, ArgumentSetters):
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
    lr_scheduler_type: SchedulerType | str = "linear"
    lr_scheduler_kwargs: dict | str | None = None
    warmup_steps: float = 0
    optim: OptimizerNames | str = "adamw_torch_fused"
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
    # A bare --activation_checkpointing / --gradient_checkpointing means true (HfArgumentParser).
    activation_checkpointing: bool | None = field(default=None, metadata=_BARE_FLAG)
    activation_checkpointing_kwargs: dict[str, Any] | str | None = None
    gradient_checkpointing: bool | None = field(default=None, metadata=_BARE_FLAG)
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = None
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    use_liger_kernel: bool = False
    liger_kernel_config: dict[str, bool] | None = None
    use_cache: bool = False
    neftune_noise_alpha: float | None = None
    torch_empty_cache_steps: int | None = None
    auto_find_batch_size: bool = False
    logging_strategy: IntervalStrategy | str = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    log_on_each_node: bool = True
    logging_nan_inf_filter: bool = True
    include_num_input_tokens_seen: str | bool = "no"
    log_level: str = field(default="passive", metadata={"choices": tuple(LOG_LEVELS)})
    log_level_replica: str = field(default="warning", metadata={"choices": tuple(LOG_LEVELS)})
    disable_tqdm: bool | None = None
    report_to: None | str | list[str] = "none"
    run_name: str | None = None
    project: str = "huggingface"
    trackio_space_id: str | None = None
    trackio_bucket_id: str | None = None
    trackio_static_space_id: str | None = None
    eval_strategy: IntervalStrategy | str = "no"
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
    save_strategy: SaveStrategy | str = "steps"
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
    hub_strategy: HubStrategy | str = "every_save"
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
    dataloader_multiprocessing_context: str | None = field(default=None, metadata={"choices": _MP_CONTEXTS})
    dataloader_in_order: bool = True
    remove_unused_columns: bool = True
    label_names: list[str] | None = None
    train_sampling_strategy: str = field(default="random", metadata={"choices": _SAMPLING})
    length_column_name: str = "length"
    ddp_find_unused_parameters: bool | None = None
    ddp_bucket_cap_mb: int | None = None
    ddp_broadcast_buffers: bool | None = None
    ddp_static_graph: bool | None = None
    ddp_backend: str | None = field(default=None, metadata={"choices": _DDP_BACKENDS})
    ddp_timeout: int = 1800
    # "full_shard auto_wrap" as one word list (a bare --fsdp: full_shard), or a list.
    fsdp: list[str] | str | None = field(default=None, metadata=_BARE_FLAG)
    fsdp_config: dict[str, Any] | str | None = None
    deepspeed: dict | str | None = None
    debug: str | list[DebugOption] = ""
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
        self._reject_unserved()
        self._normalize_enums()
        self._normalize_dicts()
        self._normalize_flags()
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
        """Named choices become their enum members (equal to their strings), as in HF."""
        def pick(name: str, enum_cls: type[enum.Enum], served: tuple[str, ...] | None = None) -> enum.Enum:
            value = getattr(self, name)
            value = value.value if isinstance(value, enum.Enum) else value
            allowed = served or tuple(e.value for e in enum_cls)
            try:
                return enum_cls(value)
            except ValueError:
                raise ArgumentError(name, f"{value!r} is not one of: {', '.join(allowed)}") from None

        self.eval_strategy = pick("eval_strategy", IntervalStrategy)
        self.logging_strategy = pick("logging_strategy", IntervalStrategy)
        self.save_strategy = pick("save_strategy", SaveStrategy)
        self.hub_strategy = pick("hub_strategy", HubStrategy)
        self.lr_scheduler_type = pick("lr_scheduler_type", SchedulerType, SERVED_SCHEDULES)
        if self.lr_scheduler_type not in SERVED_SCHEDULES:
            raise ArgumentError("lr_scheduler_type", f"{self.lr_scheduler_type.value!r} (transformers' GreedyLR) is not "
                                                     f"built by workbench; use one of: {', '.join(SERVED_SCHEDULES)}")
        self.optim = pick("optim", OptimizerNames, SERVED_OPTIMIZERS)
        problem = unserved_optimizer(self.optim)
        if problem is not None:
            raise ArgumentError("optim", problem)
        debug = self.debug  # HfArgumentParser leaves an unset list-or-string field None
        words = [] if debug is None else debug.split() if isinstance(debug, str) else list(debug)
        try:
            self.debug = [DebugOption(getattr(w, "value", w)) for w in words]
        except ValueError:
            raise ArgumentError("debug", f"{debug!r}: options are {', '.join(o.value for o in DebugOption)}") from None
        if self.debug:
            raise ArgumentError("debug", "not supported: debug options (underflow_overflow, tpu_metrics_debug) "
                                         "are not served by workbench; unset debug")
        tokens = self.include_num_input_tokens_seen
        if isinstance(tokens, bool):
            tokens = "all" if tokens else "no"
        if tokens not in ("all", "non_padding", "no"):
            raise ArgumentError("include_num_input_tokens_seen", f"{tokens!r} is not one of: all, non_padding, no")
        self.include_num_input_tokens_seen = tokens
        for name, choices in (("train_sampling_strategy", _SAMPLING), ("log_level", tuple(LOG_LEVELS)),
                              ("log_level_replica", tuple(LOG_LEVELS))):
            if getattr(self, name) not in choices:
                raise ArgumentError(name, f"{getattr(self, name)!r} is not one of: {', '.join(choices)}")
        if self.ddp_backend not in (None, *_DDP_BACKENDS):
            raise ArgumentError("ddp_backend", f"{self.ddp_backend!r} is not a torch.distributed backend "
                                               f"({', '.join(_DDP_BACKENDS)})")

    def _normalize_dicts(self) -> None:
        """JSON text (a command line's) becomes dicts; accelerator_config an AcceleratorConfig."""
        for name in _DICT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str) and value.lstrip().startswith("{"):
                setattr(self, name, typed_strings(json_or_dict(name, value)))
        try:
            self.accelerator_config = AcceleratorConfig.from_value(self.accelerator_config)
        except ValueError as exc:
            raise ArgumentError("accelerator_config", str(exc).removeprefix("accelerator_config: ")) from None
        unserved = self.accelerator_config.unserved()
        if unserved is not None:
            raise ArgumentError("accelerator_config", f"{unserved[0]} is not supported: {unserved[1]}")
        self.lr_scheduler_kwargs = json_or_dict("lr_scheduler_kwargs", self.lr_scheduler_kwargs)
        self.fsdp_config = json_or_dict("fsdp_config", json_file("fsdp_config", self.fsdp_config))
        self.deepspeed = json_or_dict("deepspeed", json_file("deepspeed", self.deepspeed))
        self.fsdp = fsdp_options(self.fsdp)
        if self.deepspeed and importlib.util.find_spec("deepspeed") is None:
            raise ArgumentError("deepspeed", "DeepSpeed is not installed (pip install deepspeed), or unset deepspeed")
        if self.fsdp and self.deepspeed:
            raise ArgumentError(None, "fsdp and deepspeed are both set; choose one")
        if self.fsdp_config and not self.fsdp:
            raise ArgumentError("fsdp_config", 'applies only with fsdp set (e.g. fsdp = "full_shard auto_wrap")')
        for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
            setattr(self, name, json_or_dict(name, getattr(self, name)))

    def _normalize_flags(self) -> None:
        """Values HF derives from others in __post_init__, derived the same way."""
        # gradient_checkpointing* are HF's older names: used when the new one is unset, then
        # mirroring it, so a dataclasses.replace of either name takes effect.
        for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                         ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            if getattr(self, new) is None and getattr(self, old) is not None:
                setattr(self, new, getattr(self, old))
            setattr(self, old, getattr(self, new))
        if self.activation_checkpointing is None:
            self.activation_checkpointing = self.gradient_checkpointing = False
        if self.disable_tqdm is None:
            self.disable_tqdm = False
        if self.eval_strategy != "no":
            self.do_eval = True
        if self.torch_compile_mode is not None or self.torch_compile_backend is not None:
            self.torch_compile = True
        if self.torch_compile and self.torch_compile_backend is None:
            self.torch_compile_backend = "inductor"
        if self.use_cpu:
            self.dataloader_pin_memory = False

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
            check_steps(name, getattr(self, name))
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
                if self.eval_strategy == "steps" and not is_multiple(self.save_steps, self.eval_steps):
                    raise ArgumentError(
                        "load_best_model_at_end",
                        f"requires save_steps ({self.save_steps}) to be a multiple of eval_steps ({self.eval_steps})",
                    )
        if self.lr_scheduler_type == "reduce_lr_on_plateau" and self.eval_strategy == "no":
            raise ArgumentError("lr_scheduler_type", 'reduce_lr_on_plateau steps after each evaluation: set eval_strategy '
                                                     'to "steps" or "epoch"')
        if self.eval_on_start and self.eval_strategy == "no":
            raise ArgumentError("eval_on_start", 'evaluates before training, so eval_strategy must not be "no"')

    def _validate_precision(self) -> None:
        if self.fp16 and self.bf16:
            raise ArgumentError(None, "fp16 and bf16 are both set: choose one mixed-precision mode")
        if self.fp16_full_eval and self.bf16_full_eval:
            raise ArgumentError(None, "fp16_full_eval and bf16_full_eval are both set: choose one")
        import torch

        # fp16 on a CPU is accepted, as HF accepts it: Accelerate then trains in float32 (the
        # Trainer says so), and fp16_full_eval evaluates under float16 autocast.
        on_gpu = not self.use_cpu and torch.cuda.is_available()
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
            if sink not in (*REPORT_SINKS, "all", "none"):
                raise ArgumentError("report_to", f"{sink!r} is not available; choose from: {', '.join((*REPORT_SINKS, 'all', 'none'))}")
        if "none" in sinks:
            sinks = []
        elif "all" in sinks:
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
            elif isinstance(value, list) and value and isinstance(value[0], enum.Enum):
                value = [v.value for v in value]
            elif isinstance(value, AcceleratorConfig):
                value = value.to_dict()
            out[f.name] = value
        return out

    def to_json_string(self) -> str:
        """The arguments as indented JSON."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """Like to_dict, with values a tracker accepts (scalars and strings only)."""
        return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in self.to_dict().items()}
