"""In-memory rollback points of a run, for the guard's rollback (issue #18).

A rollback point is what a rollback needs to put the run back at an earlier step boundary:
weights, optimizer, schedule, RNG streams, the step counters, the data position and the
guard's detector. Unlike a checkpoint it is never written: the tensors are host copies
(``host_copy``), so taking one blocks only for the device-to-host copy, and a rollback
reads no file. Each process keeps its own (DDP replicas are equal; RNG streams are not),
so taking one is not a collective. FSDP shards are not supported (the guard refuses).

The ring keeps the newest ``size`` points; memory is ``size`` x (weights + optimizer), where
the weights of a PEFT model are its trainable (adapter) tensors and buffers only: its frozen
base cannot change, so a copy of it per point would be a whole model of host memory for
nothing (``rollback_weights``). (The front-ends' ``Snapshot`` is something else: the
published view of a run, door/values.py.)
"""

from __future__ import annotations

import copy
import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from workbench.checkpoint.state_dicts import host_copy
from workbench.core.rng import capture_rng, restore_rng
from workbench.core.run import LoopPosition, Run
from workbench.core.trainer_utils import unwrap_model
from workbench.models.adapters import is_peft_model


__all__ = ["RollbackPoint", "RollbackRing", "rollback_weights"]


def rollback_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The entries of ``model.state_dict()`` a rollback point holds: those training can change
    (the tensors themselves, not copies).

    Of a PEFT model: every entry but the frozen parameters, i.e. the trainable (adapter)
    parameters and the buffers, so a rollback point holds the adapter, not the base model.
    peft freezes the base by construction and nothing in a run unfreezes it. Of any other
    model: the whole state dict, frozen parameters included, because a user's callback may
    unfreeze layers mid-run (gradual unfreezing) and a rollback past that must restore them.
    """
    state = model.state_dict()
    if not is_peft_model(model):
        return state
    frozen = _frozen_names(model)
    return {name: t for name, t in state.items() if name not in frozen}


def _frozen_names(model: torch.nn.Module) -> set[str]:
    # remove_duplicate=False: a tied frozen weight is in the state dict under each of its names.
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


@dataclass
class RollbackPoint:
    """One step boundary of the run, in host memory."""

    step: int
    epoch: float
    position: LoopPosition  # where the data goes on from this boundary
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    detector: dict[str, Any]  # GuardMonitor.export() minus the interventions

    @classmethod
    def take(cls, run: Run, detector: dict[str, Any]) -> "RollbackPoint":
        """Copy this process's state to host memory (blocks for the device-to-host copies)."""
        optimizer = getattr(run.optimizer, "optimizer", run.optimizer)
        return cls(
            step=run.state.global_step,
            epoch=run.state.epoch,
            position=dataclasses.replace(run.position),
            # state_dict keeps tied weights under every name: load_state_dict wants them all.
            model=host_copy(rollback_weights(unwrap_model(run.model))),
            optimizer=host_copy(optimizer.state_dict()),
            scheduler=host_copy(run.lr_scheduler.state_dict()),
            rng=capture_rng(),
            detector={k: v for k, v in detector.items() if k != "interventions"},
        )

    def restore(self, run: Run) -> None:
        """Put weights, optimizer, schedule, RNG, step counters and position back (copies in,
        the point itself stays usable for a second rollback)."""
        self._restore_weights(unwrap_model(run.model))
        optimizer = getattr(run.optimizer, "optimizer", run.optimizer)
        # Copies: on the CPU load_state_dict keeps the very tensors (and the scheduler the lists)
        # it is given, which the next steps update in place; a second rollback to this point
        # would then find the later state.
        optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        run.lr_scheduler.load_state_dict(copy.deepcopy(self.scheduler))
        restore_rng(self.rng)
        run.state.global_step = self.step
        run.state.epoch = self.epoch
        run.position = dataclasses.replace(self.position)

    def _restore_weights(self, model: torch.nn.Module) -> None:
        """Load the point's weights into ``model``: strictly when the point holds the whole
        state dict; of a PEFT model's trainable part, every name of the point must load and
        only the frozen base (which no step changed) may be left out."""
        if not is_peft_model(model):
            model.load_state_dict(self.model)
            return
        missing, unexpected = model.load_state_dict(self.model, strict=False)
        left_out = set(missing) - _frozen_names(model)
        if unexpected or left_out:
            raise RuntimeError(f"rollback point does not fit the model: unexpected {sorted(unexpected)[:3]}, "
                               f"missing {sorted(left_out)[:3]}")


class RollbackRing:
    """The newest ``size`` rollback points, taken every ``every`` steps and at every save."""

    def __init__(self, every: int, size: int) -> None:
        self.every = every
        self._ring: deque[RollbackPoint] = deque(maxlen=size)

    def due(self, step: int, saving: bool = False) -> bool:
        """Whether a rollback point belongs to this step boundary (a host-int test: no sync).

        ``saving``: a checkpoint of this boundary is being written, which is a rollback point
        whatever the step (ActiveGuard.prepare_save).
        """
        return (step % self.every == 0 or saving) and (not self._ring or self._ring[-1].step != step)

    def add(self, point: RollbackPoint) -> None:
        self._ring.append(point)

    def before(self, step: int) -> RollbackPoint | None:
        """The newest point taken before ``step`` ran (boundary < step), dropping the newer
        ones: they hold steps a rollback undoes."""
        while self._ring and self._ring[-1].step >= step:
            self._ring.pop()
        return self._ring[-1] if self._ring else None

    def __len__(self) -> int:
        return len(self._ring)
