"""In-memory snapshots of a run, for the guard's rollback (issue #18).

A snapshot is what a rollback needs to put the run back at an earlier step boundary:
weights, optimizer, schedule, RNG streams, the step counters, the data position and the
guard's detector. Unlike a checkpoint it is never written: the tensors are host copies
(``host_copy``), so taking one blocks only for the device-to-host copy, and a rollback
reads no file. Each process keeps its own (DDP replicas are equal; RNG streams are not),
so taking one is not a collective. FSDP shards are not supported (the guard refuses).

The ring keeps the newest ``size`` snapshots; memory is ``size`` x (weights + optimizer).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from workbench.checkpoint.state_dicts import host_copy
from workbench.train.rng import capture_rng, restore_rng
from workbench.train.trainer_utils import unwrap_model


__all__ = ["Snapshot", "SnapshotRing"]

Trainer = Any  # annotations only: Trainer imports this module (directly or not), so it is not imported back


@dataclass
class Snapshot:
    """One step boundary of the run, in host memory."""

    step: int
    epoch: float
    position: tuple[int, int]  # (epoch, micro-batch in that epoch) the next step starts at
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    detector: dict[str, Any]  # GuardMonitor.export() minus the interventions

    @classmethod
    def take(cls, trainer: "Trainer", position: tuple[int, int], detector: dict[str, Any]) -> "Snapshot":
        """Copy this process's state to host memory (blocks for the device-to-host copies)."""
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        return cls(
            step=trainer.state.global_step,
            epoch=trainer.state.epoch,
            position=position,
            # state_dict keeps tied weights under every name: load_state_dict wants them all.
            model=host_copy(unwrap_model(trainer.model).state_dict()),
            optimizer=host_copy(optimizer.state_dict()),
            scheduler=host_copy(trainer.lr_scheduler.state_dict()),
            rng=capture_rng(),
            detector={k: v for k, v in detector.items() if k != "interventions"},
        )

    def restore(self, trainer: "Trainer") -> None:
        """Put weights, optimizer, schedule, RNG and step counters back (copies in, the
        snapshot itself stays usable for a second rollback)."""
        unwrap_model(trainer.model).load_state_dict(self.model)
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        # load_state_dict casts to the parameters' devices (new tensors: the ring's stay intact).
        optimizer.load_state_dict(self.optimizer)
        trainer.lr_scheduler.load_state_dict(self.scheduler)
        restore_rng(self.rng)
        trainer.state.global_step = self.step
        trainer.state.epoch = self.epoch


class SnapshotRing:
    """The newest ``size`` snapshots, taken every ``every`` steps and at every save."""

    def __init__(self, every: int, size: int) -> None:
        self.every = every
        self._ring: deque[Snapshot] = deque(maxlen=size)

    def due(self, step: int, saving: bool = False) -> bool:
        """Whether a snapshot belongs to this step boundary (a host-int test: no sync).

        ``saving``: a checkpoint of this boundary is being written, which is a snapshot point
        whatever the step (see TrainingLoop.snapshot_for_save).
        """
        return (step % self.every == 0 or saving) and (not self._ring or self._ring[-1].step != step)

    def add(self, snapshot: Snapshot) -> None:
        self._ring.append(snapshot)

    def before(self, step: int) -> Snapshot | None:
        """The newest snapshot taken before ``step`` ran (boundary < step), dropping the newer
        ones: they hold steps a rollback undoes."""
        while self._ring and self._ring[-1].step >= step:
            self._ring.pop()
        return self._ring[-1] if self._ring else None

    def __len__(self) -> int:
        return len(self._ring)
