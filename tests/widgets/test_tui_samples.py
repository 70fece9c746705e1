"""The dashboard's samples panel, driven with Pilot over a real run that samples: hidden
(and its key out of the footer) until the run has samples, then each prompt with its
answers newest first; ``a`` hides and shows it. The pure pieces (SampleBook, answer_text)
are checked as plain functions."""

from __future__ import annotations

from workbench import SamplesCallback, Session
from workbench.widgets.tui.panels import SamplesPanel
from workbench.widgets.view import SampleBook, answer_text, describe_event

from support.dashboard import drive, press, wait_for
from support.lm import lm_trainer
from support.steering import PauseAt

PROMPTS = ["def ", "import "]


def _footer_keys(app) -> set[str]:
    return {binding.key for (_, binding, enabled, _) in app.screen.active_bindings.values() if enabled}


def test_the_samples_panel_shows_each_prompt_then_its_answers_newest_first(tmp_path):
    samples = SamplesCallback(prompts=PROMPTS, max_new_tokens=6, every=10)
    pause = PauseAt(5)
    trainer = lm_trainer(tmp_path / "run", max_steps=30, callbacks=[pause, samples])
    session = Session(trainer, control=False)
    pause.session = session
    seen: dict = {}

    async def scenario(app, pilot):
        panel = app.dashboard.query_one(SamplesPanel)
        await wait_for(pilot, lambda: session.status == "paused", "the pause at step 5")
        await pilot.pause(0.3)  # the bridge polls every 0.1 s: whatever came is shown
        assert not panel.display and "a" not in _footer_keys(app)  # nothing sampled before step 10
        await press(pilot, "space")
        await wait_for(pilot, lambda: session.status == "finished", "the run to finish")
        await wait_for(pilot, lambda: app.dashboard.samples.count == 6, "the six answers")
        await wait_for(pilot, lambda: panel.display, "the samples panel")
        assert "a" in _footer_keys(app)
        seen["text"] = str(panel.query_one("#samples-text").render())
        await press(pilot, "a")
        await wait_for(pilot, lambda: not panel.display, "the panel hidden")
        await press(pilot, "a")
        await wait_for(pilot, lambda: panel.display, "the panel shown again")

    drive(session, scenario, size=(100, 40))
    lines = seen["text"].splitlines()
    answers = {(s["step"], s["prompt"]): s["answer"] for s in samples.history}
    expected = []
    for prompt in PROMPTS:
        expected.append(f"▸ {answer_text(prompt)}")
        expected += [f"  {step}  {answer_text(answers[step, prompt])}" for step in (30, 20, 10)]
    assert lines == expected


def test_a_sample_book_gathers_answers_by_prompt_newest_first():
    book = SampleBook(per_prompt=2)
    assert not book and not book.add("evaluated", 3, {"eval_loss": 1.0})
    for step, prompt, answer in ((10, "a", "x"), (10, "b", "y"), (20, "a", "z"), (30, "a", "w")):
        assert book.add("sampled", step, {"prompt": prompt, "answer": answer, "tokens": 1})
    assert [(p, [(a.step, a.answer) for a in answers]) for p, answers in book.prompts()] == [
        ("a", [(30, "w"), (20, "z")]), ("b", [(10, "y")])]  # the newest per_prompt of each
    assert book.count == 4 and describe_event("sampled", 10, {"prompt": "a", "answer": "x"}) is None
    assert answer_text("one\ntwo") == "one↵two" and answer_text("   ") == "(only white space: 3 characters)"
    assert answer_text("abcdef", 4) == "abc…"
    book.clear()
    assert not book and book.count == 0
