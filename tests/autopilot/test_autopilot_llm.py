"""The LLM-driven policy example (examples/agent_llm_policy.py, issue 28): a model behind a
function plugs into the autopilot's schema. With the example's offline stand-in it halves the
rate on a plateau; a model that asks for anything outside the limits (another key, a value
out of range, too many changes, an answer that is not JSON) changes nothing in the run."""

from __future__ import annotations

import json
import sys

from workbench.autopilot import Limits

from support import REPO, finish
from support.autopilot import FLAT, edits, scripted_run

sys.path.insert(0, str(REPO / "examples"))
from agent_llm_policy import LLMPolicy, parse_answer, steer  # noqa: E402


def test_the_stand_in_model_halves_the_rate_on_a_plateau(tmp_path, sessions):
    session = scripted_run(tmp_path / "run", sessions, FLAT, max_steps=60).start()
    limits = Limits({"lr_scale": (0.25, 1.0)}, max_changes=1, per_steps=1000)
    pilot = steer(session, limits=limits, metric="eval_score", interval=0.02)
    assert finish(session) == "finished"
    policy = pilot.policies[0]
    assert isinstance(policy, LLMPolicy) and policy.answers  # the model was asked after evaluations
    made = edits(session)
    assert [e["lr_scale"] for e in made] == [0.5]
    assert made[0]["reason"] == "autopilot/llm: no improvement on 0.7 in the last 3 evaluations"


def test_a_model_can_never_act_outside_the_limits(tmp_path, sessions):
    answers = iter([
        json.dumps({"change": {"learning_rate": 10.0}, "reason": "much faster"}),
        json.dumps({"change": {"lr_scale": 0.01}, "reason": "almost stop"}),
        json.dumps({"change": {"schedule": {"op": "rewarm", "steps": 0, "peak": 1.0}}, "reason": "restart"}),
        "I think you should lower the learning rate a lot.",
        json.dumps({"change": {"lr_scale": 0.5}, "reason": "a little slower"}),
    ])
    prompts: list[str] = []

    def model(prompt: str) -> str:
        prompts.append(prompt)
        return next(answers, json.dumps({"change": {"lr_scale": 0.5}, "reason": "slower again"}))

    session = scripted_run(tmp_path / "run", sessions, FLAT, max_steps=80).start()
    pilot = steer(session, ask=model, limits=Limits({"lr_scale": (0.25, 1.0)}, max_changes=1, per_steps=1000),
                  metric="eval_score", interval=0.02)
    assert finish(session) == "finished"
    assert "allowed changes: lr_scale in [0.25, 1]; at most 1 change(s) per 1000 steps" in prompts[0]
    states = [d.state for d in pilot.decisions]
    assert states[:4] == ["refused", "refused", "refused", "applied"], pilot.decisions
    assert set(states[4:]) <= {"refused"} and len(states) > 4  # every later change: over the rate limit
    assert [e["lr_scale"] for e in edits(session)] == [0.5]  # the only change the run saw
    assert parse_answer("not json {") is None and parse_answer('{"change": null}') is None
