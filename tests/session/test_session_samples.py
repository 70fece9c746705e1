"""A Session's samples: each answer a SamplesCallback gives is a ``sampled`` event in the
Session's history (what the front-ends read), and a ``sample`` record in events.jsonl; an
evaluation asked for on a paused run samples too, and the run stays bitwise what it would
be without any of it. ``Session.sample`` still goes through the shared generation path."""

from __future__ import annotations

from workbench import SamplesCallback, Session

from support import DEADLINE, assert_same_weights, wait_until
from support.lm import lm_trainer
from support.sampling import losses, sample_records
from support.steering import PauseAt

PROMPTS = ["def ", "for i in "]


def test_samples_are_session_events_and_a_paused_evaluation_samples_without_changing_the_run(tmp_path, sessions):
    plain = lm_trainer(tmp_path / "plain", dropout=0.1, eval_strategy="steps", eval_steps=20)
    plain.train()
    pause = PauseAt(13)
    samples = SamplesCallback(prompts=PROMPTS, max_new_tokens=6, temperature=0.8, seed=5)
    trainer = lm_trainer(tmp_path / "run", dropout=0.1, eval_strategy="steps", eval_steps=20,
                         callbacks=[pause, samples])
    session = Session(trainer, control=False)
    sessions.append(session)
    pause.session = session
    session.start()
    wait_until(lambda: session.status == "paused", "the pause at step 13", DEADLINE)
    session.evaluate()  # paused: at once, and it samples at step 13
    session.evaluate()  # the same weights: no second sample point at step 13
    session.resume()
    assert session.wait(timeout=DEADLINE) == "finished"

    events = [e for e in session.events_since(0)[0] if e.kind == "sampled"]
    assert [(e.step, e.data["prompt"]) for e in events] == [(step, p) for step in (13, 20, 40) for p in PROMPTS]
    assert all(set(e.data) == {"prompt", "answer", "tokens"} and e.data["tokens"] == 6 for e in events)
    assert [(e.step, e.data) for e in events] == [(s["step"], {k: v for k, v in s.items() if k != "step"})
                                                    for s in samples.history]
    assert [(r["step"], r["prompt"], r["answer"], r["tokens"]) for r in sample_records(tmp_path / "run")] == [
        (e.step, e.data["prompt"], e.data["answer"], e.data["tokens"]) for e in events]
    # Sampling with a temperature, while paused and at the evaluations, left every stream as it was.
    assert_same_weights(trainer.model, plain.model)
    assert [x for x in losses(trainer) if x[1] == "loss"] == [x for x in losses(plain) if x[1] == "loss"]
    # The paused-run sampler shares the generation path: greedy and repeatable.
    assert session.sample("def ", max_new_tokens=8, temperature=0) == session.sample("def ", max_new_tokens=8,
                                                                                      temperature=0)


def test_session_sample_on_a_transformers_model_raises_no_generation_warning(tmp_path, sessions, finetune_workspace):
    """``session.sample()`` on a paused transformers model whose generation_config sets sampling
    flags (as a checkpoint's generation_config.json does): greedy and sampled answers come without
    transformers' "generation flags are not valid" warning or any other about generation
    (issue 29, item 10), while a bare greedy generate on that model does warn."""
    from support.sampling import PROMPTS as CHAT_PROMPTS, llama_trainer, no_generation_warnings

    pause = PauseAt(2)
    trainer = llama_trainer(finetune_workspace, tmp_path / "run", max_steps=4, callbacks=[pause],
                            generation_defaults={"do_sample": True, "temperature": 0.6, "top_p": 0.9})
    session = Session(trainer, control=False)
    sessions.append(session)
    pause.session = session
    session.start()
    wait_until(lambda: session.status == "paused", "the pause at step 2", DEADLINE)
    with no_generation_warnings(trainer, CHAT_PROMPTS[0]):
        greedy = session.sample(CHAT_PROMPTS[0], max_new_tokens=4, temperature=0)
        sampled = session.sample(CHAT_PROMPTS[0], max_new_tokens=4, temperature=0.8, seed=3)
    assert isinstance(greedy, str) and isinstance(sampled, str)
    session.resume()
    assert session.wait(timeout=DEADLINE) == "finished"
