"""The typed run: the state one Trainer's training holds, declared in one place; the
override points of the HF facade that the loop and the layers below it call; and the
steering gates the loop calls at named points (``Gate``, ``Gates``: where a run may wait).

``Trainer`` (workbench/train/trainer.py) *is* a ``Run``: it sets these attributes and
implements the hooks at the bottom, with HF's names and signatures, so a subclass that
overrides ``save_model`` or ``evaluate`` is what every layer calls. The layers below the
Trainer (checkpoint, distributed, guard) take a ``Run`` instead of an untyped trainer, and
read or change only what is declared here. Who changes what:

- ``args``, ``accelerator``, ``callback_handler``, ``stop_request``, ``stop_decision``,
  ``gates`` and ``checkpoint_writer`` are made once, by the Trainer's constructor.
- ``model``, ``model_wrapped``, ``optimizer`` and ``lr_scheduler`` are the Trainer's (and
  the user's, as in HF); the loop wraps them when a run starts.
- ``state``, ``control``, ``workbench_state`` and ``position`` are the run's state: made
  anew by each ``train()``, restored from a checkpoint, advanced by the loop alone;
  ``control`` flags are also set by callbacks and gates. A rollback (the guard) puts the
  state and the position back to an in-memory snapshot.
- ``loop``, ``updates_per_epoch``, ``last_inputs``, ``current_flos`` and
  ``current_gradient_accumulation_steps`` belong to the ``train()`` call under way.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from workbench.core.rng import rng_preserved

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from accelerate import Accelerator

    from workbench.core.args.training import TrainingArguments
    from workbench.core.callbacks import CallbackHandler
    from workbench.core.state import TrainerControl, TrainerState, WorkbenchState
    from workbench.core.stop import StopRequest

__all__ = ["Run", "LoopPosition", "LoopHooks", "Writer", "Gate", "Gates"]


@dataclass
class LoopPosition:
    """Where the loop is, advanced in one place (the loop, after each optimizer step and at
    each epoch start) and saved with every checkpoint (``workbench_state.json``): a resume
    continues the data from here, a rollback puts it back, the guard names the rows at it.

    ``epoch`` is the epoch being trained and ``batch`` the micro-batches of it this process
    has taken (the next one's index); ``update`` the optimizer steps taken (``global_step``);
    ``samples`` the samples this process has trained on; ``skipped`` the micro-batches
    guard rollbacks jumped over, in all, so the data no longer follows from the step.
    """

    epoch: int = 0
    batch: int = 0
    update: int = 0
    samples: int = 0
    skipped: int = 0

    def normalized(self, batches_per_epoch: int | None) -> tuple[int, int]:
        """(epoch, micro-batch) the next step starts at: past an epoch's last batch is the
        next epoch's first (an epoch of unknown length never ends here)."""
        if batches_per_epoch and self.batch >= batches_per_epoch:
            return self.epoch + self.batch // batches_per_epoch, self.batch % batches_per_epoch
        return self.epoch, self.batch

    def export(self) -> dict[str, int]:
        """For ``workbench_state.json``."""
        return dataclasses.asdict(self)

    @classmethod
    def restore(cls, saved: dict[str, Any] | None) -> "LoopPosition | None":
        """From ``export()``; None when there is nothing saved (an older or HF checkpoint)."""
        if not saved:
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: int(v) for k, v in saved.items() if k in names})


class LoopHooks(Protocol):
    """What the loop of a ``train()`` under way offers to a save made at its boundary."""

    def log_loss(self, start_time: float, learning_rate: float | None = None) -> None:
        """Log the loss since the last log (a logging point)."""

    def prepare_save(self) -> None:
        """Bring ``workbench_state`` up to date for a checkpoint of this boundary: the unlogged
        loss, the guard's records, the position (a rollback's ring keeps this boundary too)."""

    def pending_batches(self) -> list[dict[str, Any]]:
        """The host random streams of batches collated but not trained yet (core/rng.py)."""


class Writer(Protocol):
    """Writes checkpoints in the background, one at a time (checkpoint/async_save.py)."""

    def submit(self, job: Callable[[], Any]) -> None: ...

    def wait(self) -> None: ...


class Run(ABC):
    """The state of one Trainer's runs (module docstring); the Trainer sets every attribute."""

    args: "TrainingArguments"
    accelerator: "Accelerator"
    model: "torch.nn.Module"  # the user's model, unwrapped
    model_wrapped: "torch.nn.Module"  # what the loop calls: DDP / FSDP / compiled, or the model itself
    processing_class: Any
    optimizer: Any  # a torch optimizer (Accelerate's wrapper with loss scaling or engines); None until made
    lr_scheduler: Any
    callback_handler: "CallbackHandler"
    stop_request: "StopRequest"  # signals, front-ends and the guard set it
    stop_decision: "StopRequest"  # what the loop acts on: the request itself, or the ranks' agreement of it
    gates: "Gates"  # the steering gates (below), called by the loop at its named points
    checkpoint_writer: Writer

    state: "TrainerState"
    control: "TrainerControl"
    workbench_state: "WorkbenchState"
    position: LoopPosition

    loop: LoopHooks | None = None
    updates_per_epoch: int | None = None  # optimizer steps an epoch, as the loop planned them
    last_inputs: Any = None  # the newest micro-batch (a reference, for inspection while paused)
    current_flos: float = 0.0
    current_gradient_accumulation_steps: int = 1
    # Run health (core/ledger.py, distributed/health.py): where the wall time goes, the
    # watchdog of the train() under way, and who hears of a hang or a straggler (a Session).
    ledger: Any = None
    health: Any = None  # the Health settings
    health_monitor: Any = None
    health_listeners: list = []
    # Who hears of a live edit the run makes itself (an out-of-memory recovery's cut, and a
    # Session's own set()): called with its record by core/edits.py record_edit (a Session).
    edit_listeners: list = []

    # What the Trainer's constructor learned about the model and the user's choices.
    guard: Any = None  # the Guard settings (workbench/guard/settings.py); None: off
    model_kind: str | None = None  # a key of models/losses.py LOSS_MAPPING ("ForCausalLM", ...)
    compute_loss_func: Any = None
    _train_batch_size: int  # per device (auto_find_batch_size may lower it)
    _init_memory_metrics: dict[str, int]  # HF's init-stage memory metrics, added to train()'s

    # -- the override points the loop and the layers below call (the Trainer implements them) --

    @abstractmethod
    def get_train_dataloader(self) -> Any:
        """The training DataLoader (HF's)."""

    @abstractmethod
    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """Make the optimizer and the schedule for a run of ``num_training_steps`` (HF's)."""

    @abstractmethod
    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> "torch.Tensor":
        """Forward and backward of one micro-batch; the detached loss (HF's)."""

    @abstractmethod
    def floating_point_ops(self, inputs: Any) -> int:
        """Floating-point operations of one micro-batch's forward and backward (HF's)."""

    @abstractmethod
    def _maybe_log_save_evaluate(self, tr_loss: Any, grad_norm: Any, model: Any, trial: Any, epoch: float | None,
                                 ignore_keys_for_eval: list[str] | None, start_time: float,
                                 learning_rate: float | None = None) -> None:
        """At a step or epoch end: log, evaluate and save as the flags say (HF's)."""

    @abstractmethod
    def _evaluate(self, trial: Any, ignore_keys_for_eval: list[str] | None, skip_scheduler: bool = False) -> dict:
        """An evaluation during training (HF's)."""

    @abstractmethod
    def _memory_stage(self, stage: str, start: bool) -> dict[str, int]:
        """Start or stop a stage's memory metrics (HF's skip_memory_metrics=False)."""

    @abstractmethod
    def is_world_process_zero(self) -> bool:
        """Whether this is the main process of the whole run (HF's)."""

    @abstractmethod
    def is_local_process_zero(self) -> bool:
        """Whether this is the main process on this machine (HF's)."""

    @abstractmethod
    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate and return the metrics (HF's ``Trainer.evaluate``)."""

    @abstractmethod
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Record ``logs`` in the state's history and tell the callbacks (HF's ``Trainer.log``)."""

    @abstractmethod
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model files (HF's ``Trainer.save_model``)."""

    @abstractmethod
    def _save_checkpoint(self, model: Any, trial: Any) -> "Path | None":
        """Write ``checkpoint-<step>`` (HF's ``Trainer._save_checkpoint``)."""

    @abstractmethod
    def _get_output_dir(self, trial: Any = None) -> str:
        """Where checkpoints go (HF's ``Trainer._get_output_dir``)."""

    @abstractmethod
    def _get_learning_rate(self) -> float:
        """The learning rate HF logs (HF's ``Trainer._get_learning_rate``)."""

    @abstractmethod
    def store_flos(self) -> None:
        """Add this process's floating-point operations to ``state.total_flos`` (HF's)."""

    # -- what is done between steps, outside the loop (a paused run) ---------------------------

    def save_between_steps(self) -> Any:
        """Save a checkpoint outside the loop (a paused run): RNG streams untouched, the files
        published before this returns, on_save callbacks told. Returns the checkpoint path."""
        with rng_preserved():
            path = self._save_checkpoint(self.model, trial=None)
            self.checkpoint_writer.wait()
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        return path

    def evaluate_between_steps(self) -> dict[str, float]:
        """Evaluate outside the loop (a paused run), leaving the RNG streams and train mode as
        they were."""
        model = self.model
        was_training = model.training
        with rng_preserved():
            try:
                return self.evaluate()
            finally:
                model.train(was_training)

    @abstractmethod
    def fork_between_steps(self, action: str, order: dict[str, Any]) -> None:
        """On a rank other than 0 of a paused run: take part in rank 0's fork, keep or discard
        (``order`` as rank 0 decided it; train/forking.py)."""


# -- steering gates ----------------------------------------------------------------------

class Gate:
    """A steering hook: what the training loop asks, at named points, of the layers that steer
    it. Every method does nothing unless overridden.

    HF callbacks observe a run and set ``TrainerControl`` flags; they keep exactly HF's hooks.
    What *steers* a run from outside (a pause that holds the loop, the agreement between ranks,
    a stop requested by a signal or a front-end) is a gate instead: registered by the layer
    that owns it, and called by the loop at a few named points in a fixed order, so where a
    run can wait is visible in the loop (workbench/train/loop.py) rather than hidden in a list
    of callbacks. The points, in the order a step meets them:

    - ``train_begin``: a run starts (or restarts after a resume).
    - ``step_start``: after the callbacks' ``on_step_begin``, before the step trains. A gate
      may **wait** here: the steering gate holds a paused run; on ranks other than 0 the
      agreement waits out rank 0's pause. A stop asked for meanwhile ends the run before the
      step (its micro-batches fetched, not trained).
    - ``after_backward``: the gradients are reduced, the optimizer step is next (the rank
      agreement starts its exchange here, when every rank has just left a collective).
    - ``step_end``: after the callbacks' ``on_step_end``: commands become flags (save,
      evaluate, edits), the ranks' agreement is applied, a requested stop becomes save + stop.
    - ``evaluation_point``: at each evaluation batch and once an evaluation ends: a stop
      requested meanwhile cuts it short.
    - ``train_end``: the run ends (before the callbacks' ``on_train_end``).

    At every point the gates run in ``ORDER``: the rank **agreement** first (every rank acts on
    what the ranks agreed), then the **steering** of a front-end (a Session: pause and
    commands), then the **stop** (the just-in-time checkpoint). A slot left empty costs nothing.
    """

    def train_begin(self, run: Run) -> None:
        """A run starts."""

    def step_start(self, run: Run) -> None:
        """Before a step trains; may wait (a pause)."""

    def after_backward(self, run: Run) -> None:
        """Gradients reduced, optimizer step next."""

    def step_end(self, run: Run) -> None:
        """A step ended: turn requests into ``run.control`` flags."""

    def evaluation_point(self, run: Run) -> None:
        """An evaluation batch ran, or an evaluation ended."""

    def train_end(self, run: Run) -> None:
        """The run ends."""

    def pause_for_guard(self, run: Run) -> bool:
        """The guard asks the run to pause (its pause action, max_interventions, no
        progress): True when this gate will hold the run before its next step. A run no one
        can resume (headless, several processes) answers False and stops instead."""
        return False


class Gates:
    """A run's gates, one slot each, called in ``ORDER`` at every point."""

    ORDER = ("agreement", "steering", "stop")

    def __init__(self) -> None:
        self.agreement: Gate | None = None  # the ranks' agreement (workbench/distributed/rank_sync.py)
        self.steering: Gate | None = None  # a front-end's pause and commands (workbench/session/)
        self.stop: Gate | None = None  # the just-in-time checkpoint on a stop request (distributed/signals.py)
        self._active: tuple[Gate, ...] = ()

    def set(self, slot: str, gate: Gate | None) -> None:
        """Put ``gate`` in ``slot`` (one of ORDER), replacing what was there; None empties it."""
        if slot not in self.ORDER:
            raise ValueError(f"gates: no slot {slot!r}; slots: {', '.join(self.ORDER)}")
        setattr(self, slot, gate)
        self._active = tuple(g for g in (getattr(self, name) for name in self.ORDER) if g is not None)

    def train_begin(self, run: Run) -> None:
        for gate in self._active:
            gate.train_begin(run)

    def step_start(self, run: Run) -> None:
        for gate in self._active:
            gate.step_start(run)

    def after_backward(self, run: Run) -> None:
        for gate in self._active:
            gate.after_backward(run)

    def step_end(self, run: Run) -> None:
        for gate in self._active:
            gate.step_end(run)

    def evaluation_point(self, run: Run) -> None:
        for gate in self._active:
            gate.evaluation_point(run)

    def train_end(self, run: Run) -> None:
        for gate in self._active:
            gate.train_end(run)

    def pause_for_guard(self, run: Run) -> bool:
        """Whether a gate holds the run for the guard (else the run stops with a checkpoint)."""
        return any(gate.pause_for_guard(run) for gate in self._active)

    def __iter__(self) -> Any:
        return iter(self._active)
