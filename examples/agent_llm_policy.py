"""A language model steering a run through the autopilot: the model proposes, the limits decide.

    python examples/agent_llm_policy.py              # offline: a small local run, a stand-in model
    python examples/agent_llm_policy.py runs/mlp     # a live run (workbench run CONFIG --headless)

The model is a function you supply, ``ask(prompt: str) -> str`` (an API client, a local
model): after each evaluation it is shown the run's recent evaluations, its learning rate,
the changes made so far and the limits, and answers one JSON object,
``{"change": {"lr_scale": 0.5}, "reason": "..."}`` or ``{"change": null}``. The answer is an
Action like any policy's: the Autopilot checks it against the limits (which keys, which
ranges, how many changes per how many steps) and sends it with its reason, or refuses it in
one line and sends nothing. Whatever the model says, it cannot act outside the limits.

This file ships ``stand_in_model``, a few lines of rules that answer like a model would, so
the example runs without a network or weights; pass your own function as ``ask``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from workbench.autopilot import Action, Autopilot, Limits, Observation, metric_values

LIMITS = Limits({"lr_scale": (0.25, 1.0), "decay_now": {"steps": (20, 400)}}, max_changes=2, per_steps=200)


class LLMPolicy:
    """Asks ``ask`` (a language model behind a function) after each new evaluation."""

    name = "llm"

    def __init__(self, ask: Callable[[str], str], metric: str = "eval_loss", history: int = 8) -> None:
        self.ask, self.metric, self.history = ask, metric, history
        self.evaluations: list[tuple[int, float]] = []
        self.answers: list[str] = []  # what the model said, for the record

    def observe(self, seen: Observation) -> Action | None:
        """One question per poll that brought new evaluations; the answer read as an Action."""
        new = metric_values(seen.events, self.metric)
        if not new:
            return None
        self.evaluations = (self.evaluations + new)[-self.history:]
        answer = self.ask(prompt_for(seen, self.metric, self.evaluations))
        self.answers.append(answer)
        return parse_answer(answer)


def prompt_for(seen: Observation, metric: str, evaluations: list[tuple[int, float]]) -> str:
    """The question: the run's state, the allowed changes, and the answer's format."""
    snapshot = seen.snapshot
    made = [{k: v for k, v in e.items() if k not in ("time",)} for e in snapshot.edits[-5:]]
    return "\n".join([
        "You steer a neural network's training run. Decide whether to change its learning rate now.",
        f"step: {seen.step} of {snapshot.max_steps}",
        f"learning rate now: {snapshot.latest('learning_rate')}",
        f"recent evaluations ({metric}, lower is better): {json.dumps(evaluations)}",
        f"changes made so far: {json.dumps(made)}",
        f"allowed changes: {seen.limits.describe()}",
        'Answer with one JSON object: {"change": {"lr_scale": 0.5}, "reason": "one line"}, or '
        '{"change": {"schedule": {"op": "decay_now", "steps": 100, "to": "min_lr"}}, "reason": "..."}, '
        'or {"change": null, "reason": "..."} to change nothing.',
    ])


def parse_answer(text: str) -> Action | None:
    """The model's answer as an Action (None: no change, or an answer that is not JSON)."""
    start, end = text.find("{"), text.rfind("}")
    try:
        answer = json.loads(text[start:end + 1]) if start >= 0 else None
    except json.JSONDecodeError:
        return None
    if not isinstance(answer, dict) or not isinstance(answer.get("change"), dict):
        return None
    return Action(answer["change"], str(answer.get("reason") or "the model asked for it"))


def stand_in_model(prompt: str) -> str:
    """Answers like a model would, offline: halve the rate when the last three evaluations
    did not improve on the best one before them, else change nothing."""
    line = next(row for row in prompt.splitlines() if row.startswith("recent evaluations"))
    values = [value for _, value in json.loads(line.split(": ", 1)[1])]
    if len(values) < 4 or min(values[-3:]) < min(values[:-3]):
        return json.dumps({"change": None, "reason": "still improving"})
    return json.dumps({"change": {"lr_scale": 0.5},
                       "reason": f"no improvement on {min(values[:-3]):.4g} in the last 3 evaluations"})


def steer(session: Any, ask: Callable[[str], str] = stand_in_model, limits: Limits = LIMITS,
          metric: str = "eval_loss", interval: float = 0.1) -> Autopilot:
    """Run the LLM policy on ``session`` (any SessionLike) until the run ends; returns the autopilot."""
    pilot = Autopilot(session, LLMPolicy(ask, metric), limits, watch=metric, interval=interval)
    pilot.run()
    return pilot


def _local_run(out: str) -> Any:
    """A small run to steer offline: the built-in MLP on random classes, evaluated every 10 steps."""
    import torch

    from workbench import Session, Trainer, TrainingArguments
    from workbench.data.builtin import load_builtin_data
    from workbench.models import MLPClassifier

    train, evals = load_builtin_data("random-classification", n_train=256, n_eval=64, in_features=8, num_classes=3,
                                     seed=1)
    torch.manual_seed(0)
    args = TrainingArguments(out, max_steps=400, learning_rate=3e-2, eval_strategy="steps", eval_steps=10,
                             logging_steps=10, save_strategy="no", report_to="none", disable_tqdm=True)
    return Session(Trainer(model=MLPClassifier(in_features=8, hidden=16, num_classes=3), args=args,
                           train_dataset=train, eval_dataset=evals))


def main() -> None:
    """Steer the run at TARGET, or a small local run, with the stand-in model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?", help="a live run's output_dir (or HOST:PORT); none: a local run")
    parser.add_argument("--output-dir", default="runs/agent-llm", help="the local run's output_dir")
    ns = parser.parse_args()
    if ns.target:
        import workbench

        session = workbench.attach(ns.target)
    else:
        session = _local_run(ns.output_dir).start()
    pilot = steer(session)
    for decision in pilot.decisions:
        print(decision.line())
    loss = session.snapshot().latest("eval_loss")
    if loss is not None:
        print(f"last eval_loss {loss:.4g}")


if __name__ == "__main__":
    main()
