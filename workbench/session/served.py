"""``Trainer.train()`` with ``control = true``: the same call, served by a Session.

The Trainer API stays what it is: training runs in the caller's thread, errors propagate,
and the call returns the TrainOutput. Only, while it runs, rank 0 serves the control
endpoint (control.json in output_dir), so ``workbench ctl`` and ``workbench attach`` can
pause, edit, save, evaluate and stop it. The other ranks train as before and follow rank 0
through the rank agreement (distributed/rank_sync.py).
"""

from __future__ import annotations

from typing import Any

from workbench.session.local import Session
from workbench.train.trainer import Trainer

__all__ = ["train_with_control"]

def train_with_control(trainer: Trainer, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
                       ignore_keys_for_eval: list[str] | None = None) -> Any:
    """Train ``trainer`` in this thread through a Session that serves the control endpoint;
    returns the TrainOutput. The Session is taken off the Trainer again afterwards, so a
    later train() starts clean (and serves again)."""
    session = Session(trainer, resume_from_checkpoint=resume_from_checkpoint, control=True,
                      control_port=trainer.args.control_port, control_host=trainer.args.control_host,
                      train_kwargs={"trial": trial, "ignore_keys_for_eval": ignore_keys_for_eval})
    session.branches_here = False  # a remote branch would make this call train another Trainer
    # A guard's pause keeps the plain Trainer's meaning (stop with a checkpoint): no one may
    # be attached to resume it.
    session.pauses_for_guard = False
    try:
        session.run()
        return session.train_output
    finally:
        session.detach()
