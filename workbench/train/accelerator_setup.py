"""The Accelerator a Trainer runs on, built from its TrainingArguments, and the model and
optimizer prepared on it when a run starts.

Kept apart from trainer.py so the Trainer class stays about the methods users override.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from workbench.core.args.training import TrainingArguments
from workbench.core.run import Run

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator


__all__ = ["make_accelerator", "check_sharding", "prepare_for_training", "optimizer_needs_wrapper"]


def make_accelerator(args: TrainingArguments) -> "Accelerator":
    """An Accelerator configured from the arguments (fresh state for each Trainer).

    Each Trainer gets its own, as a new Trainer may want another precision or other
    data-loader settings than the one before it in the same process.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs

    from workbench.core.world import distributed_state, wants_cpu

    # The distributed state first, made once with these arguments (world.py says why); then
    # a fresh AcceleratorState, as a new Trainer may want another precision.
    distributed_state(args)
    AcceleratorState._reset_state()
    # An AcceleratorConfig (TrainingArguments checked its keys and refused the unserved ones).
    config = args.accelerator_config
    dataloader_config = DataLoaderConfiguration(split_batches=config.split_batches,
                                                dispatch_batches=config.dispatch_batches,
                                                even_batches=config.even_batches, non_blocking=config.non_blocking)
    ddp = {k: getattr(args, f"ddp_{k}") for k in ("find_unused_parameters", "bucket_cap_mb",
                                                   "broadcast_buffers", "static_graph")}
    ddp = {k: v for k, v in ddp.items() if v is not None}
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    if precision == "fp16" and (wants_cpu(args) or not _has_fp16_device()):
        # As transformers: accepted, and Accelerate trains in float32 there (no CPU fp16 autocast).
        logging.getLogger("workbench").warning("fp16: this run is on the CPU, where Accelerate trains in float32 "
                                               "(as transformers' Trainer does); use bf16 for mixed precision there")
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs

    from workbench.distributed.sharding import accelerator_plugins

    handlers: list[Any] = [DistributedDataParallelKwargs(**ddp)] if ddp else []
    if args.ddp_backend is not None or args.ddp_timeout != 1800:
        group = {"timeout": timedelta(seconds=args.ddp_timeout)}
        if args.ddp_backend is not None:
            group["backend"] = args.ddp_backend
        handlers.append(InitProcessGroupKwargs(**group))
    return Accelerator(
        mixed_precision=precision,
        cpu=wants_cpu(args),
        dataloader_config=dataloader_config,
        step_scheduler_with_optimizer=False,
        kwargs_handlers=handlers or None,
        **accelerator_plugins(args),
    )


def _has_fp16_device() -> bool:
    import torch

    return torch.cuda.is_available() or torch.backends.mps.is_available()


def check_sharding(trainer: Run) -> None:
    """Refuse an ``fsdp`` run that Accelerate did not shard.

    Accelerate quietly falls back to DDP where it cannot shard; saying so at construction
    beats a run that trains unsharded while the user believes otherwise.
    """
    from workbench.core.args.training import ArgumentError
    from workbench.checkpoint.state_dicts import is_fsdp

    if trainer.args.fsdp and not is_fsdp(trainer):
        kind = trainer.accelerator.distributed_type.value
        raise ArgumentError("fsdp", f"Accelerate did not start FSDP here (this run is {kind}, "
                                    f"{trainer.accelerator.num_processes} process(es)): FSDP needs several processes "
                                    "on GPUs or other accelerators (Accelerate does not shard on CPU ranks); "
                                    "launch with --num-processes N on such a machine, or unset fsdp")


def optimizer_needs_wrapper(accelerator: "Accelerator") -> bool:
    """Accelerate's optimizer wrapper is needed for loss scaling and sharded engines only.

    Elsewhere it adds per-step work (package probes on every step()) and nothing else:
    gradients are synchronized by DDP and accumulation is handled by the loop.
    """
    from accelerate.utils import DistributedType

    plain = accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
    return not plain or accelerator.scaler is not None


def prepare_for_training(run: Run) -> "torch.nn.Module":
    """Wrap the run's model (and, where needed, its optimizer) for training on its Accelerator:
    activation checkpointing, DDP / FSDP, ``torch.compile``. Sets ``run.model_wrapped`` (and
    ``run.optimizer`` when wrapped) and returns the model the loop calls."""
    import torch

    from workbench.checkpoint.state_dicts import is_fsdp

    args, acc, model = run.args, run.accelerator, run.model
    if args.activation_checkpointing:
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise ValueError(
                f"activation_checkpointing: {type(model).__name__} has no gradient_checkpointing_enable(); "
                "use a model that supports it or unset activation_checkpointing"
            )
        enable(gradient_checkpointing_kwargs=args.activation_checkpointing_kwargs)
    if is_fsdp(run):
        # FSDP replaces the parameters by shards: the optimizer must be prepared with the
        # model so it steps the shards.
        wrapped, run.optimizer = acc.prepare(model, run.optimizer)
        run.model_wrapped = wrapped
    else:
        run.model_wrapped = wrapped = acc.prepare(model)
        if optimizer_needs_wrapper(acc):
            run.optimizer = acc.prepare(run.optimizer)
    if args.torch_compile:
        kwargs = {k: v for k, v in (("backend", args.torch_compile_backend), ("mode", args.torch_compile_mode)) if v}
        wrapped = torch.compile(wrapped, **kwargs)
        run.model_wrapped = wrapped
    return wrapped
