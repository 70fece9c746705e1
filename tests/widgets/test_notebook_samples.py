"""The notebook panel's Samples tab, with real ipywidgets objects over a real run that samples:
each prompt, then its answers newest first with their steps and token counts; the tab's
title counts the prompts. Samples stay out of the Events tab."""

from __future__ import annotations

import html

import pytest

from workbench import SamplesCallback, Session

from support import DEADLINE
from support.lm import lm_trainer

PROMPTS = ["def ", "return "]


def test_the_samples_tab_lists_each_prompts_answers_newest_first(tmp_path):
    pytest.importorskip("bqplot")
    Panel = pytest.importorskip("workbench.widgets.notebook").Panel  # needs ipywidgets and bqplot
    samples = SamplesCallback(prompts=PROMPTS, max_new_tokens=6, temperature=1.0, seed=2)  # answers that differ
    trainer = lm_trainer(tmp_path / "run", max_steps=20, eval_strategy="steps", eval_steps=10, callbacks=[samples])
    session = Session(trainer, control=False)
    panel = Panel(session, autostart=False)
    try:
        titles = tuple(panel.tabs.titles)
        assert titles[4] == "Samples" and titles[5] == "Guard"
        assert panel.tabs.children[4] is panel.samples and "no samples" in panel.samples.value
        session.start()
        assert session.wait(timeout=DEADLINE) == "finished"
        panel.refresh()
        assert panel.tabs.titles[4] == "Samples (2)"
        shown = html.unescape(panel.samples.value)
        for prompt in PROMPTS:
            at = shown.index(f">{prompt}</div>")
            mine = shown[at:shown.index("</table>", at)]
            newest, oldest = [s["answer"] for step in (20, 10) for s in samples.history
                              if s["step"] == step and s["prompt"] == prompt]
            assert mine.index(newest) < mine.index(oldest) and mine.index(">20<") < mine.index(">10<")
            assert ">6<" in mine  # the tokens column
        assert shown.index(f">{PROMPTS[0]}</div>") < shown.index(f">{PROMPTS[1]}</div>")
        assert "sampled" not in panel.events.value and "def " not in panel.events.value
    finally:
        panel.close()
