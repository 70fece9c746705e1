"""The Accelerator a Trainer runs on, built from its TrainingArguments.

Kept apart from trainer.py so the Trainer class stays about the methods users override.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from workbench.train.args import TrainingArguments

if TYPE_CHECKING:
    from accelerate import Accelerator


__all__ = ["make_accelerator", "check_sharding"]

Trainer = Any  # annotations only: Trainer imports this module (directly or not), so it is not imported back


def make_accelerator(args: TrainingArguments) -> "Accelerator":
    """An Accelerator configured from the arguments (fresh state for each Trainer).

    Each Trainer gets its own, as a new Trainer may want another precision or other
    data-loader settings than the one before it in the same process.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs

    from workbench.distributed.world import distributed_state, wants_cpu

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


def check_sharding(trainer: "Trainer") -> None:
    """Refuse an ``fsdp`` run that Accelerate did not shard.

    Accelerate quietly falls back to DDP where it cannot shard; saying so at construction
    beats a run that trains unsharded while the user believes otherwise.
    """
    from workbench.train.args import ArgumentError
    from workbench.checkpoint.state_dicts import is_fsdp

    if trainer.args.fsdp and not is_fsdp(trainer):
        kind = trainer.accelerator.distributed_type.value
        raise ArgumentError("fsdp", f"Accelerate did not start FSDP here (this run is {kind}, "
                                    f"{trainer.accelerator.num_processes} process(es)): FSDP needs several processes "
                                    "on GPUs or other accelerators (Accelerate does not shard on CPU ranks); "
                                    "launch with --num-processes N on such a machine, or unset fsdp")
