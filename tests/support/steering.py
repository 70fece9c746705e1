"""Steering a run from its own callbacks (pause or stop at a step, record where each train()
starts) and comparing two runs' losses and optimizer state."""

from __future__ import annotations

import torch

from workbench import Trainer, TrainerCallback


def loss_logs(trainer: Trainer) -> list[dict]:
    return [e for e in trainer.state.log_history if "loss" in e]


def assert_same_optimizer_state(a: Trainer, b: Trainer) -> None:
    oa = getattr(a.optimizer, "optimizer", a.optimizer).state_dict()
    ob = getattr(b.optimizer, "optimizer", b.optimizer).state_dict()
    assert oa["state"].keys() == ob["state"].keys() and oa["state"]
    for idx in oa["state"]:
        sa, sb = oa["state"][idx], ob["state"][idx]
        assert sa.keys() == sb.keys()
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert torch.equal(sa[key], sb[key]), f"optimizer state {idx}/{key} differs"
            else:
                assert sa[key] == sb[key]
    assert [g["lr"] for g in oa["param_groups"]] == [g["lr"] for g in ob["param_groups"]]


class PauseAt(TrainerCallback):
    """Asks the session to pause at the end of step ``step`` (so it blocks before the next)."""

    def __init__(self, step: int) -> None:
        self.step, self.session = step, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.session is not None:
            self.session.pause()


class StopSessionAt(TrainerCallback):
    """Calls session.stop(save=True) once, at the beginning of step ``step + 1``: the run
    stops at that boundary, before step ``step + 1`` runs."""

    def __init__(self, step: int) -> None:
        self.step, self.session, self.done = step, None, False

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.session is not None and not self.done:
            self.done = True
            self.session.stop(save=True)


class BeginSteps(TrainerCallback):
    """Records the global step each train() starts from."""

    def __init__(self) -> None:
        self.starts: list[int] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.starts.append(state.global_step)


# Every event a TrainerCallback can receive, in HF's names.
HOOKS = ["on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
         "on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end",
         "on_step_end", "on_log", "on_evaluate", "on_prediction_step", "on_save"]


class Recorder(TrainerCallback):
    """Implements every hook; records (hook name without on_, global_step)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


def _make_hook(hook: str):
    """The Recorder's method for ``hook``."""
    def hook_fn(self, args, state, control, **kwargs):
        self.events.append((hook[3:], state.global_step))
    hook_fn.__name__ = hook
    return hook_fn


for _hook in HOOKS:
    setattr(Recorder, _hook, _make_hook(_hook))
