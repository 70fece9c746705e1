"""The run's state objects: HF's ``TrainerState`` and ``TrainerControl`` (exactly the fields
transformers' have), the ``ExportableState`` mixin of stateful callbacks, and
``WorkbenchState``: what workbench adds (live edits, the unlogged loss, the guard's records),
kept apart so that ``dataclasses.asdict(trainer.state)`` is what transformers' Trainer would
hold, and saved as ``workbench_state.json`` beside ``trainer_state.json``.

transformers is never imported here: its callbacks are recognised by the names of the
classes they derive from (``is_hf_class``), so ``isinstance`` checks written against
workbench's classes also accept transformers' (see ``ExportableState.__subclasshook__``).
"""

from __future__ import annotations

from workbench.core.names import WORKBENCH_STATE_NAME

import abc
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ExportableState",
    "TrainerState",
    "TrainerControl",
    "WorkbenchState",
    "WORKBENCH_STATE_FIELDS",
    "WORKBENCH_STATE_NAME",
    "is_hf_class",
]

HF_CALLBACK_MODULE = "transformers.trainer_callback"


def is_hf_class(cls: type, name: str) -> bool:
    """Whether ``cls`` is, or derives from, transformers' class ``name`` of its callback
    module (found through the MRO, so transformers need not be imported to ask)."""
    return any(c.__name__ == name and c.__module__ == HF_CALLBACK_MODULE for c in getattr(cls, "__mro__", ()))


class ExportableState(abc.ABC):
    """Mixin for callbacks whose state is saved in checkpoints (HF's ExportableState).

    A transformers ``ExportableState`` (e.g. its ``EarlyStoppingCallback``) counts as one
    too: ``isinstance(cb, workbench.ExportableState)`` is True for it, so it is saved and
    restored like workbench's own.
    """

    def state(self) -> dict:
        """``{"args": constructor kwargs, "attributes": mutable state}``."""
        raise NotImplementedError("stateful callbacks implement state()")

    @classmethod
    def from_state(cls, state: dict) -> "ExportableState":
        """Rebuild the callback from what ``state()`` returned."""
        instance = cls(**state["args"])
        for key, value in state["attributes"].items():
            setattr(instance, key, value)
        return instance

    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        # Only for this class itself: a subclass's isinstance keeps its usual meaning.
        if cls is ExportableState and is_hf_class(other, "ExportableState"):
            return True
        return NotImplemented


# workbench's own run state, kept out of trainer_state.json (in workbench_state.json).
WORKBENCH_STATE_FIELDS = ("live_edits", "loss_window", "guard", "position", "memory")


@dataclass
class TrainerState:
    """What the loop knows about the run; saved as trainer_state.json in checkpoints.

    The fields are transformers' TrainerState's, and only those (workbench's additions are
    in ``WorkbenchState``), so transformers reads the file and a resumed run's state is
    equal to an uninterrupted one's.
    """

    epoch: float = 0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0
    log_history: list[dict[str, float]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # As HF's: None means empty, and a list of stateful callbacks is stored as their states
        # by class name (a list of states when several share a class).
        if self.log_history is None:
            self.log_history = []
        if self.stateful_callbacks is None:
            self.stateful_callbacks = {}
        elif not isinstance(self.stateful_callbacks, dict):
            states: dict[str, Any] = {}
            for callback in self.stateful_callbacks:
                if not isinstance(callback, ExportableState):
                    raise TypeError(f"stateful_callbacks: {type(callback).__name__} is not an ExportableState")
                name, state = type(callback).__name__, callback.state()
                if name not in states:
                    states[name] = state
                elif isinstance(states[name], list):
                    states[name].append(state)
                else:
                    states[name] = [states[name], state]
            self.stateful_callbacks = states

    def to_json_string(self) -> str:
        """The state as indented JSON: trainer_state.json, as transformers writes and reads it."""
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    def save_to_json(self, json_path: str) -> None:
        """Write trainer_state.json (``Trainer.save_state`` and checkpoints)."""
        Path(json_path).write_text(self.to_json_string(), encoding="utf-8")

    @classmethod
    def load_from_json(cls, json_path: str) -> "TrainerState":
        """Read trainer_state.json (written here or by transformers). Unknown keys are
        ignored: a newer transformers' fields, and workbench's own that older checkpoints
        kept in this file (``WorkbenchState.load`` reads those)."""
        data = json.loads(Path(json_path).read_text(encoding="utf-8"))
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def compute_steps(self, args: Any, max_steps: int) -> None:
        """Resolve logging/eval/save steps given as ratios of ``max_steps`` (HF rule)."""
        for name in ("logging", "eval", "save"):
            value = getattr(args, f"{name}_steps")
            if value is None:
                continue
            steps = math.ceil(max_steps * value) if value < 1 else int(value)
            setattr(self, f"{name}_steps", max(1, steps))


@dataclass
class WorkbenchState:
    """What workbench adds to a run's state, saved as workbench_state.json in checkpoints.

    ``live_edits``: hyperparameter edits applied during the run, replayed on resume.
    ``loss_window``: the training loss not yet logged (since step ``since_step``), so a
    resumed run logs the same values as an uninterrupted one. ``guard``: the guard's
    interventions and detector state (workbench/guard/), so a resumed run repeats the
    uninterrupted one's decisions. ``position``: where the data goes on (the loop's
    position and the micro-batches an epoch it was counted in).
    """

    live_edits: list[dict[str, Any]] = field(default_factory=list)
    loss_window: dict[str, Any] | None = None
    guard: dict[str, Any] | None = None
    position: dict[str, Any] | None = None  # the loop's position (core/run.py LoopPosition)
    # The device memory at the save, for the forecast of a resume with a larger batch
    # (train/memory.py forecast_problem): peak, model tensors, rows a micro-batch, total.
    memory: dict[str, Any] | None = None

    def to_json_string(self) -> str:
        """workbench_state.json's text (``format`` 1)."""
        return json.dumps({"format": 1, **dataclasses.asdict(self)}, indent=2, sort_keys=True) + "\n"

    @classmethod
    def load(cls, checkpoint: str | Path) -> "WorkbenchState":
        """The state a checkpoint folder holds: its workbench_state.json, or for a checkpoint
        written before that file existed, the same fields in its trainer_state.json. A
        checkpoint transformers wrote has neither: an empty state."""
        folder = Path(checkpoint)
        data: dict[str, Any] = {}
        for name in ("trainer_state.json", WORKBENCH_STATE_NAME):  # the newer file wins
            path = folder / name
            if path.is_file():
                saved = json.loads(path.read_text(encoding="utf-8"))
                data.update({k: saved[k] for k in WORKBENCH_STATE_FIELDS if k in saved})
        state = cls(**data)
        state.live_edits = list(state.live_edits or [])
        return state


@dataclass
class TrainerControl(ExportableState):
    """Flags callbacks set to steer the loop; the loop resets them after acting. Saved in
    checkpoints with the stateful callbacks, as in HF."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False

    def state(self) -> dict:
        """The flags, as ``{"args": ..., "attributes": {}}`` (HF's ExportableState form)."""
        return {"args": dataclasses.asdict(self), "attributes": {}}
