"""The run's world: one distributed state, made once, and a guard that it is what it seems.

Accelerate keeps its distributed state in a process-wide singleton (``PartialState``). The
first caller's arguments win: a bare ``PartialState()`` made by data loading on a machine
without GPUs reports a single process even under ``torchrun``, and the Trainer's
Accelerator built after it silently trains alone. So the state is made here, in one place,
with the arguments the Trainer's Accelerator uses (cpu, backend, timeout), before anything
else asks for it; data loading, the Trainer and the CLI all call :func:`distributed_state`.

:func:`check_world` turns the whole class of such bugs into one loud line: when the
launcher says this process is one of N > 1 and Accelerate reports another count, the run
refuses to start.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["WorldSizeMismatch", "launched_world_size", "distributed_state", "check_world", "wants_cpu",
           "process_group_kwargs", "is_main_process"]

# Where launchers say how many processes there are: torchrun / accelerate launch, MPI, srun.
_WORLD_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


class WorldSizeMismatch(RuntimeError):
    """The launcher started N processes but Accelerate sees another number (one line)."""


def launched_world_size() -> tuple[int, str] | None:
    """How many processes the environment says this run has, and which variable says so.

    ``SLURM_STEP_NUM_TASKS`` counts only inside an ``srun`` step (an ``sbatch`` script that
    runs one Python process is one process, whatever ``--ntasks`` says).
    """
    for name in _WORLD_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value), name
    if os.environ.get("SLURM_STEP_ID") is not None:
        value = os.environ.get("SLURM_STEP_NUM_TASKS", "").strip()
        if value.isdigit():
            return int(value), "SLURM_STEP_NUM_TASKS"
    return None


def _has_accelerator() -> bool:
    import torch

    probe = getattr(torch, "accelerator", None)
    if probe is not None and hasattr(probe, "is_available"):
        return bool(probe.is_available())
    return torch.cuda.is_available()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def wants_cpu(args: Any = None) -> bool:
    """Whether this process trains on the CPU: ``use_cpu``, ``ACCELERATE_USE_CPU``, or a
    multi-process launch on a machine with no accelerator (where Accelerate needs ``cpu=True``
    to form a gloo group; without it each rank would train alone)."""
    if args is not None and getattr(args, "use_cpu", False):
        return True
    if _env_flag("ACCELERATE_USE_CPU"):
        return True
    world = launched_world_size()
    return world is not None and world[0] > 1 and not _has_accelerator()


def process_group_kwargs(args: Any = None) -> dict[str, Any]:
    """``init_process_group`` options from the arguments (backend, timeout), as the Trainer's
    Accelerator passes them through ``InitProcessGroupKwargs``."""
    from datetime import timedelta

    if args is None:
        return {}
    out: dict[str, Any] = {}
    if getattr(args, "ddp_backend", None) is not None:
        out["backend"] = args.ddp_backend
    timeout = getattr(args, "ddp_timeout", 1800)
    if timeout != 1800:
        out["timeout"] = timedelta(seconds=timeout)
    return out


def distributed_state(args: Any = None) -> Any:
    """Accelerate's ``PartialState`` for this process, made once with the Trainer's arguments.

    With one process a state made earlier with another device choice is replaced (nothing
    distributed to tear down). With several it cannot be: the first one stays and
    :func:`check_world` says whether it is usable.
    """
    from accelerate.state import AcceleratorState, PartialState

    cpu = wants_cpu(args)
    if "process_index" in PartialState._shared_state:
        state = PartialState()
        if state.num_processes > 1:
            check_world(state, made_here=False)
            return state
        world = launched_world_size()
        if bool(getattr(state, "_cpu", False)) == cpu and (world is None or world[0] <= 1):
            return state
        # A single-process state from an earlier Trainer (or a bare PartialState() made before
        # workbench's): remake it with this run's arguments.
        AcceleratorState._reset_state(reset_partial_state=True)
    try:
        state = PartialState(cpu=cpu, **process_group_kwargs(args))
    except BaseException:
        PartialState._reset_state()  # a half-made state would answer later callers wrongly
        raise
    check_world(state, made_here=True)
    return state


def check_world(state: Any, made_here: bool = True) -> None:
    """Raise :class:`WorldSizeMismatch` when the launcher's process count differs from Accelerate's."""
    world = launched_world_size()
    if world is None:
        return
    expected, source = world
    actual = state.num_processes
    if expected == actual:
        return
    if expected > 1 and actual == 1 and not made_here:
        cause = ("an accelerate PartialState or Accelerator was created before workbench's with other arguments; "
                 "let workbench create it (build the Trainer first), or set ACCELERATE_USE_CPU=1 for CPU ranks")
    elif expected > 1 and actual == 1:
        cause = ("the processes were started without a rendezvous (MASTER_ADDR/MASTER_PORT); start them with "
                 "'workbench run --num-processes N', 'accelerate launch' or 'torchrun'")
    else:
        cause = "the launcher's and Accelerate's settings disagree; check the accelerate config and the launcher's flags"
    raise WorldSizeMismatch(f"the launcher started {expected} processes ({source}={expected}) but Accelerate sees "
                            f"{actual} ({state.distributed_type.value}): {cause}")


def is_main_process() -> bool:
    """Whether this is the run's global rank 0 (True outside any launch)."""
    from accelerate.state import PartialState

    if "process_index" in PartialState._shared_state:
        return PartialState().is_main_process
    return os.environ.get("RANK", "0") == "0"
