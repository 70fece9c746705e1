"""The autopilot's test runs (issue 28): the small MLP with its evaluation metric scripted
through ``compute_metrics``, and a policy that asks for given actions."""

from __future__ import annotations

from workbench.autopilot import Action

from support.sessions import Slow, make_session


class Scripted:
    """``compute_metrics``: each evaluation's ``score`` is the next value (the last repeats)."""

    def __init__(self, values: list[float]) -> None:
        self.values, self.calls = values, 0

    def __call__(self, prediction) -> dict[str, float]:
        value = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return {"score": value}


class Asks:
    """A policy that asks for the given actions, one per poll, then nothing."""

    def __init__(self, *actions: Action, name: str = "asks") -> None:
        self.name = name
        self.queue = list(actions)
        self.declined_notes: list[str] = []

    def observe(self, seen):
        return self.queue.pop(0) if self.queue else None

    def declined(self, action, note):
        self.declined_notes.append(note)


def scripted_run(out, sessions, values: list[float], max_steps: int = 100_000, slow: float = 0.004, **kwargs):
    """A slowed run evaluating every 5 steps, its eval_score scripted."""
    session = make_session(out, callbacks=[Slow(slow)], compute_metrics=Scripted(values), max_steps=max_steps,
                           eval_strategy="steps", eval_steps=5, **kwargs)
    sessions.append(session)
    return session


def edits(session) -> list[dict]:
    return list(session.trainer.workbench_state.live_edits)


FLAT = [1.0, 0.8, 0.7] + [0.7] * 40  # improves twice, then flat
