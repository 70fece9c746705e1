"""The notebook panel's Schedule and Fork tabs (issue 28), with real ipywidgets and bqplot.

Schedule: a change is previewed on the learning-rate chart (dashed, nothing applied), refused
in one line when the run would refuse it, and applied as a live edit with its reason; the
chart then draws the new plan dashed after the logged rate. Fork: variants typed one a line
train from the pause, their curves are drawn over the parent's with a table, one is kept."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("bqplot")

from support import DEADLINE, Slow, make_session, wait_until  # noqa: E402


@pytest.fixture
def paneled(tmp_path, sessions):
    """A started, slowed run of 500 steps and its panel (closed afterwards)."""
    session = make_session(tmp_path / "out", callbacks=[Slow(0.004)], max_steps=500)
    sessions.append(session)
    panel = session.panel()
    session.start()
    yield session, panel
    panel.close()


def test_the_schedule_tab_previews_then_applies_a_decay(paneled):
    session, panel = paneled
    wait_until(lambda: session.snapshot().step >= 3, "the run to start")
    session.pause(wait=True, timeout=DEADLINE)
    step = session.snapshot().step
    tab = panel.schedule
    assert panel.tabs.titles[6] == "Schedule" and panel.tabs.children[6] is tab.box
    assert panel.lr_chart.lines["lr_plan"].line_style == "dashed"
    panel.refresh()
    plan = panel.lr_chart.points("lr_plan")
    assert plan and plan[0][0] == step + 1 and plan[-1][0] == 500

    tab.op.value = "decay_now"
    tab.args.value = "steps=0"
    tab.preview_button.click()
    assert 'data-level="error"' in panel.notice.value and "whole number &gt;= 1" in panel.notice.value
    tab.args.value = "steps=40 shape=cosine"
    tab.preview_button.click()
    assert "dashed orange" in panel.notice.value
    preview = panel.lr_chart.points("lr_preview")
    assert preview[0][0] == step + 1 and preview[-1][0] == step + 40
    assert session.snapshot().max_steps == 500 and not session.snapshot().edits  # a preview changes nothing

    tab.reason.value = "eval loss flat"
    tab.apply_button.click()
    assert "schedule changed" in panel.notice.value
    edit = session.snapshot().edits[-1]
    assert edit["schedule"]["op"] == "decay_now" and edit["reason"] == "eval loss flat"
    panel.refresh()
    assert panel.lr_chart.points("lr_preview") == []
    assert panel.lr_chart.points("lr_plan") == [(s, pytest.approx(v)) for s, v in preview]


def test_the_fork_tab_forks_draws_the_variants_and_keeps_one(paneled):
    from workbench.widgets.fork_view import parse_variants

    session, panel = paneled
    wait_until(lambda: session.snapshot().step >= 12, "the run to log a few losses")
    session.pause(wait=True, timeout=DEADLINE)
    step = session.snapshot().step
    tab = panel.forks
    assert panel.tabs.titles[7] == "Fork" and panel.tabs.children[7] is tab.box
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_variants("b: learning_rate")
    tab.variants.value = "a:\nb: learning_rate=nope"
    tab.steps.value = 6
    tab.fork_button.click()
    assert 'data-level="error"' in panel.notice.value and "variant b: learning_rate" in panel.notice.value
    tab.variants.value = "a:\nb: learning_rate=5e-2\nc: schedule=decay_now steps=6"
    # The memory figure is on screen before the fork starts (the kernel then waits for it).
    cost, fork, shown = session.fork_cost(parse_variants(tab.variants.value), 6), session.fork, []
    session.fork = lambda *a, **k: (shown.append(tab.memory.value), fork(*a, **k))[1]
    try:
        tab.fork_button.click()
    finally:
        del session.fork
    assert len(shown) == 1 and "forking 3 variants x 6 steps" in shown[0], shown
    assert f"{cost['bytes'] / 2**20:.1f} MiB of host memory for 3 variants (4 copies" in shown[0]
    assert "3 variants trained 6 steps" in panel.notice.value, panel.notice.value
    assert "<b>b</b>" in tab.table.value and "same batches" in tab.table.value
    assert tab.table.value.count("<td>yes</td>") == 3
    drawn = tab.chart.points("variant1")
    assert drawn[0][0] == step and drawn[-1][0] == step + 6
    assert tab.chart.lines["variant1"].labels == ["b"] and tab.chart.points("parent")
    # Each variant's evaluation is a dot after its steps, over the parent's evaluation at the pause.
    report = session.snapshot().fork
    assert tab.chart.points("parent_eval") == [(step, pytest.approx(report["parent"]["eval"]["eval_loss"]))]
    for i, name in enumerate("abc"):
        assert tab.chart.points(f"variant{i}_eval") == [(step + 6, pytest.approx(report["variants"][name]["eval"]["eval_loss"]))]
    assert tab.chart.lines["variant1_eval"].labels == ["b eval"] and tab.chart.lines["variant1_eval"].marker
    assert list(tab.keep_select.options) == ["a", "b", "c"]
    # Save c to a folder typed in, then a into the default one; a full folder is refused in one line.
    output_dir = Path(session.trainer.args.output_dir)
    tab.keep_select.value = "c"
    tab.save_folder.value = str(output_dir)
    tab.save_button.click()
    assert 'data-level="error"' in panel.notice.value and "own output_dir; a saved variant needs a folder" in panel.notice.value
    tab.save_folder.value = str(output_dir.parent / "variant-c")
    tab.save_button.click()
    saved_c = output_dir.parent / "variant-c" / f"checkpoint-{step + 6}"
    assert f"variant c saved to {saved_c}" in panel.notice.value and (saved_c / "trainer_state.json").is_file()
    tab.keep_select.value, tab.save_folder.value = "b", ""
    tab.save_button.click()
    assert f"saved to {output_dir.resolve()}-fork1-b/checkpoint-{step + 6}" in panel.notice.value
    panel.refresh()
    assert "c saved to" in tab.table.value and "b saved to" in tab.table.value
    assert session.snapshot().step == step and list(tab.keep_select.options) == ["a", "b", "c"]
    assert tab.keep_select.value == "b"  # the report changed under it; Keep now keeps the one just saved
    tab.keep_button.click()
    assert "kept b" in panel.notice.value
    assert session.snapshot().step == step + 6
    panel.refresh()
    assert "★" in tab.table.value and list(tab.keep_select.options) == []


def test_the_fork_tab_refuses_a_fork_that_would_not_fit_with_the_figure(paneled, monkeypatch):
    import workbench.session.fork_commands as fork_commands
    import workbench.train.forking as forking

    session, panel = paneled
    wait_until(lambda: session.snapshot().step >= 3, "the run to start")
    session.pause(wait=True, timeout=DEADLINE)
    monkeypatch.setattr(forking, "host_available", lambda: 2**30)
    monkeypatch.setattr(fork_commands, "_HOST_SHARE", 1e-9)  # a limit of one byte
    tab = panel.forks
    tab.variants.value = "a:\nb: learning_rate=5e-2"
    tab.steps.value = 4
    tab.fork_button.click()
    assert 'data-level="error"' in panel.notice.value and "would not fit" in panel.notice.value
    assert "3 copies of weights and optimizer state" in panel.notice.value and "the limit is 0.0 MiB" in panel.notice.value
    assert "would not fit" in tab.memory.value and "MiB of host memory for 2 variants" in tab.memory.value
    assert session.snapshot().fork is None and session.snapshot().step >= 3  # nothing forked
