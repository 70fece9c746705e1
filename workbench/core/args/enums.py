"""The named choices of TrainingArguments, with transformers' names and values.

Each is a ``str`` enum: a member compares equal to its value (``args.optim == "sgd"``),
formats, prints, quotes and serialises (JSON, TOML) as that value, and has HF's ``.value``. Every
name transformers 5.x lists is a member, so ``HfArgumentParser`` offers the same choices
as for HF's own TrainingArguments; the ones workbench cannot serve are refused by
``TrainingArguments.__post_init__`` with a line that says why (see :func:`unserved_optimizer`).
"""

from __future__ import annotations

import enum
import importlib.util

__all__ = [
    "DebugOption", "HubStrategy", "IntervalStrategy", "OptimizerNames", "ParallelMode", "SaveStrategy",
    "SchedulerType", "SERVED_OPTIMIZERS", "SERVED_SCHEDULES", "unserved_optimizer",
]


class _Choice(enum.StrEnum):
    """A named choice; its repr is its value's, so messages quoting one read as they did
    when the fields held plain strings (``save_strategy='epoch'``)."""

    def __repr__(self) -> str:
        return repr(self.value)


class IntervalStrategy(_Choice):
    NO = "no"
    STEPS = "steps"
    EPOCH = "epoch"


class SaveStrategy(_Choice):
    NO = "no"
    STEPS = "steps"
    EPOCH = "epoch"
    BEST = "best"


class HubStrategy(_Choice):
    END = "end"
    EVERY_SAVE = "every_save"
    CHECKPOINT = "checkpoint"
    ALL_CHECKPOINTS = "all_checkpoints"


class DebugOption(_Choice):
    UNDERFLOW_OVERFLOW = "underflow_overflow"
    TPU_METRICS_DEBUG = "tpu_metrics_debug"


class ParallelMode(_Choice):
    """How this process trains alongside others (``TrainingArguments.parallel_mode``)."""

    NOT_PARALLEL = "not_parallel"
    NOT_DISTRIBUTED = "not_distributed"
    DISTRIBUTED = "distributed"
    SAGEMAKER_MODEL_PARALLEL = "sagemaker_model_parallel"
    SAGEMAKER_DATA_PARALLEL = "sagemaker_data_parallel"
    TPU = "tpu"


class SchedulerType(_Choice):
    LINEAR = "linear"
    COSINE = "cosine"
    COSINE_WITH_RESTARTS = "cosine_with_restarts"
    POLYNOMIAL = "polynomial"
    CONSTANT = "constant"
    CONSTANT_WITH_WARMUP = "constant_with_warmup"
    INVERSE_SQRT = "inverse_sqrt"
    REDUCE_ON_PLATEAU = "reduce_lr_on_plateau"
    COSINE_WITH_MIN_LR = "cosine_with_min_lr"
    COSINE_WARMUP_WITH_MIN_LR = "cosine_warmup_with_min_lr"
    WARMUP_STABLE_DECAY = "warmup_stable_decay"
    GREEDY = "greedy"


class OptimizerNames(_Choice):
    ADAMW_TORCH = "adamw_torch"
    ADAMW_TORCH_FUSED = "adamw_torch_fused"
    ADAMW_TORCH_XLA = "adamw_torch_xla"
    ADAMW_TORCH_NPU_FUSED = "adamw_torch_npu_fused"
    ADAFACTOR = "adafactor"
    ADAMW_ANYPRECISION = "adamw_anyprecision"
    ADAMW_TORCH_4BIT = "adamw_torch_4bit"
    ADAMW_TORCH_8BIT = "adamw_torch_8bit"
    ADEMAMIX = "ademamix"
    SGD = "sgd"
    ADAGRAD = "adagrad"
    ADAMW_BNB = "adamw_bnb_8bit"
    ADAMW_8BIT = "adamw_8bit"
    ADEMAMIX_8BIT = "ademamix_8bit"
    LION_8BIT = "lion_8bit"
    LION = "lion_32bit"
    PAGED_ADAMW = "paged_adamw_32bit"
    PAGED_ADAMW_8BIT = "paged_adamw_8bit"
    PAGED_ADEMAMIX = "paged_ademamix_32bit"
    PAGED_ADEMAMIX_8BIT = "paged_ademamix_8bit"
    PAGED_LION = "paged_lion_32bit"
    PAGED_LION_8BIT = "paged_lion_8bit"
    RMSPROP = "rmsprop"
    RMSPROP_BNB = "rmsprop_bnb"
    RMSPROP_8BIT = "rmsprop_bnb_8bit"
    RMSPROP_32BIT = "rmsprop_bnb_32bit"
    GALORE_ADAMW = "galore_adamw"
    GALORE_ADAMW_8BIT = "galore_adamw_8bit"
    GALORE_ADAFACTOR = "galore_adafactor"
    GALORE_ADAMW_LAYERWISE = "galore_adamw_layerwise"
    GALORE_ADAMW_8BIT_LAYERWISE = "galore_adamw_8bit_layerwise"
    GALORE_ADAFACTOR_LAYERWISE = "galore_adafactor_layerwise"
    LOMO = "lomo"
    ADALOMO = "adalomo"
    GROKADAMW = "grokadamw"
    SCHEDULE_FREE_RADAM = "schedule_free_radam"
    SCHEDULE_FREE_ADAMW = "schedule_free_adamw"
    SCHEDULE_FREE_SGD = "schedule_free_sgd"
    APOLLO_ADAMW = "apollo_adamw"
    APOLLO_ADAMW_LAYERWISE = "apollo_adamw_layerwise"
    STABLE_ADAMW = "stable_adamw"


# What torch alone builds (workbench/train/optim.py); every other name needs a package.
SERVED_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop", "adafactor")
# Every schedule but "greedy" (transformers' own GreedyLR class, not a torch scheduler).
SERVED_SCHEDULES = tuple(s.value for s in SchedulerType if s is not SchedulerType.GREEDY)

# (pip name, import name) of the package each other optimizer is built from.
_PACKAGES = {
    "bitsandbytes": ("bitsandbytes", "bitsandbytes"),
    "galore": ("galore-torch", "galore_torch"),
    "apollo": ("apollo-torch", "apollo_torch"),
    "lomo": ("lomo-optim", "lomo_optim"),
    "grokadamw": ("grokadamw", "grokadamw"),
    "schedule_free": ("schedulefree", "schedulefree"),
    "stable_adamw": ("torch-optimi", "optimi"),
    "torchao": ("torchao", "torchao"),
    "xla": ("torch_xla", "torch_xla"),
    "npu": ("torch-npu", "torch_npu"),
    "anyprecision": ("torchdistx", "torchdistx"),
}


def _package_of(name: str) -> tuple[str, str]:
    if name.startswith(("galore", "apollo", "schedule_free")):
        return _PACKAGES[name.split("_")[0] if not name.startswith("schedule_free") else "schedule_free"]
    if name in ("lomo", "adalomo"):
        return _PACKAGES["lomo"]
    if name in ("adamw_torch_4bit", "adamw_torch_8bit"):
        return _PACKAGES["torchao"]
    for key, suffix in (("xla", "_xla"), ("npu", "_npu_fused"), ("anyprecision", "_anyprecision")):
        if name.endswith(suffix):
            return _PACKAGES[key]
    if name in ("grokadamw", "stable_adamw"):
        return _PACKAGES[name]
    return _PACKAGES["bitsandbytes"]  # the 8-bit, paged, lion, ademamix and bnb rmsprop family


def unserved_optimizer(name: str) -> str | None:
    """Why ``optim=name`` cannot run here (one line), or None when torch builds it.

    A name whose package is absent says which package to install; with the package present
    it says how to pass that optimizer in (workbench builds only torch's own optimizers).
    """
    if name in SERVED_OPTIMIZERS:
        return None
    pip_name, module = _package_of(name)
    served = ", ".join(SERVED_OPTIMIZERS)
    if importlib.util.find_spec(module) is None:
        return f"{name!r} needs the {pip_name} package, which is not installed (pip install {pip_name}); or use one of: {served}"
    return (f"{name!r} ({pip_name}) is not built by workbench: pass the optimizer in with Trainer(optimizer_cls_and_kwargs="
            f"(cls, kwargs)) and leave optim at its default, or use one of: {served}")
