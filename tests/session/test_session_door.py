"""One door for front-ends: the SessionLike protocol, its plain value types, and the checks
behind it.

The front-ends (widgets/) may import only the protocol and its value types from the core,
so a front-end can never grow its own copy of a rule. Each command is checked once, inside
the Session: the learning-rate rule, the branch checks and the delete checks are exercised
here through every way in (the Python API, the terminal form driven by a real Textual Pilot,
the notebook panel's real ipywidgets buttons, TrainingArguments) over real training runs of
the small MLP.
"""

from __future__ import annotations

import ast
import asyncio
import html
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench import Session, TrainingArguments
from workbench.core.edits import learning_rate_problem
from workbench.core.event_file import read_events
from workbench.door.protocol import ENDED, CheckpointRow, SessionLike, Snapshot, Status

from support import DEADLINE, REPO, Slow, finished_run, make_session, wait_until

WIDGETS = REPO / "widgets"
# What widgets/ may import from the core: the door, its value types, its words for how a run
# ended and who is calling (a refusal then names the dashboard's key, not the Python call).
DOOR = ("workbench.door.protocol", "workbench.door.values", "workbench.door.endings", "workbench.door.callers")


# --------------------------------------------------------------------------- the door itself


def _core_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import of ``workbench`` in ``path``, wherever it is
    (module level, inside functions, under TYPE_CHECKING)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "workbench"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "workbench":
            found.append((node.lineno, node.module))
    return found


def test_widgets_import_nothing_from_the_core_but_the_door():
    modules = sorted(WIDGETS.rglob("*.py"))
    assert len(modules) > 10, "widgets/ moved? the check would pass vacuously"
    bad = [f"{path.relative_to(REPO)}:{line}: {module}"
           for path in modules for line, module in _core_imports(path)
           if module not in DOOR and module != "workbench.widgets" and not module.startswith("workbench.widgets.")]
    assert not bad, "widgets/ must use only workbench.door.protocol and its value types:\n" + "\n".join(bad)
    # The widgets do use the door (the check above is not passing because nothing is imported).
    assert any(module == "workbench.door.protocol" for path in modules for _, module in _core_imports(path))


def test_the_core_imports_no_front_end_at_module_level():
    for path in sorted((REPO / "workbench").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        top = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        for statement in top:  # module level, including `if TYPE_CHECKING:` and try blocks
            for node in ast.walk(statement):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
                for name in names:
                    assert not name.startswith("workbench.widgets"), f"{path.relative_to(REPO)}:{node.lineno}: {name}"


def test_the_door_imports_without_torch_or_a_front_end():
    code = ("import sys, workbench.door.protocol, workbench.door.values; "
            "bad = [m for m in ('torch', 'textual', 'ipywidgets', 'workbench.session.local', 'workbench.train', "
            "'workbench.checkpoint', 'workbench.config') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_session_is_session_like_and_every_status_is_the_one_enum(tmp_path, sessions):
    from workbench.widgets.notebook.tables import STATUS_COLORS
    from workbench.widgets.tui.panels import STATUSES
    from workbench.widgets.view import TERMINAL

    session = make_session(tmp_path, max_steps=5)
    sessions.append(session)
    assert isinstance(session, SessionLike)
    assert session.status is Status.IDLE and session.snapshot().status is Status.IDLE
    seen = {session.start().wait(timeout=DEADLINE)}
    seen.add(session.snapshot().status)
    assert seen == {Status.FINISHED} and session.status == "finished", "a str enum still equals its word"
    assert Status.FINISHED.ended and not Status.PAUSED.ended and set(ENDED) == {"finished", "stopped", "failed"}
    # The front-ends' status tables come from the enum, so a new status cannot be forgotten.
    assert STATUSES == tuple(Status) and set(STATUS_COLORS) == set(Status) and TERMINAL is ENDED


def test_status_words_are_spelled_in_one_place():
    # Words that are only statuses (not also event kinds or outcomes) must not appear as
    # string literals outside the enum's module.
    words = {"idle", "running", "pausing", "evaluating", "saving", "stopping"}
    state = REPO / "workbench" / "door" / "values.py"
    files = [*WIDGETS.rglob("*.py"), *(REPO / "workbench" / "session").glob("*.py"),
             *(REPO / "workbench" / "door").glob("*.py")]
    bad = [f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}"
           for path in files if path != state
           for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
           if isinstance(node, ast.Constant) and node.value in words]
    assert not bad, "use workbench.door.values.Status instead of the word:\n" + "\n".join(bad)


def test_events_since_hands_out_every_event_once(tmp_path, sessions):
    session = make_session(tmp_path, max_steps=20, eval_strategy="steps", eval_steps=10)
    sessions.append(session)
    assert session.events_since(0) == ([], 0)
    assert session.start().wait(timeout=DEADLINE) == Status.FINISHED
    events, cursor = session.events_since(0)
    kinds = [e.kind for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished" and kinds.count("evaluated") == 2
    assert cursor == len(events)
    assert session.events_since(cursor) == ([], cursor), "a cursor never hands an event out twice"
    later, _ = session.events_since(cursor - 1)
    assert [e.kind for e in later] == ["finished"]
    for bad in (-1, cursor + 1, "0", True):
        with pytest.raises(ValueError, match="cursor"):
            session.events_since(bad)


# --------------------------------------------------------------------------- one learning-rate rule


BAD_RATES = (float("nan"), float("inf"), -1.0)


def test_one_learning_rate_rule_for_the_api_the_panel_and_training_arguments(tmp_path, sessions):
    pytest.importorskip("ipywidgets")
    from workbench.widgets.notebook import Panel

    session = make_session(tmp_path / "run", callbacks=[Slow()], save_strategy="steps", save_steps=3)
    sessions.append(session)
    session.start()
    wait_until(lambda: session.snapshot().step >= 3, "a few steps and a checkpoint")
    assert session.pause(wait=True, timeout=DEADLINE) == Status.PAUSED
    trainer = session.trainer
    base = list(trainer.lr_scheduler.base_lrs)
    panel = Panel(session, autostart=False)
    try:
        for bad in BAD_RATES:
            rule = f"learning_rate: {learning_rate_problem(bad)}"
            assert "expected a finite number >= 0" in rule
            # The Python API: set() and its stand-alone check, with numbers and with text.
            with pytest.raises(ValueError) as refused:
                session.set(learning_rate=bad)
            assert str(refused.value) == rule
            with pytest.raises(ValueError) as refused:
                session.validate_edits({"learning_rate": str(bad)})
            assert str(refused.value) == rule
            # TrainingArguments: the same rule, named by the field.
            with pytest.raises(ValueError) as refused:
                TrainingArguments(str(tmp_path / "args"), learning_rate=bad, report_to="none")
            assert str(refused.value) == rule
            # The notebook panel's LR field: the session's words in the notice, nothing applied.
            panel.lr_field.value = str(bad)
            panel.lr_apply.click()
            assert 'data-level="error"' in panel.notice.value and html.escape(rule) in panel.notice.value, \
                panel.notice.value
            assert trainer.lr_scheduler.base_lrs == base, f"{bad!r} reached the optimizer"
        # A branch's learning rate goes through the same rule (TrainingArguments inside check_branch).
        panel.refresh()
        assert panel.checkpoint_select.value
        session.stop(save=False)
        session.wait(timeout=DEADLINE)
        panel.branch_lr.value = "nan"
        panel.branch_dir.value = str(tmp_path / "branch")
        panel.branch_button.click()
        rule = html.escape(f"learning_rate: {learning_rate_problem(float('nan'))}")
        assert rule in panel.notice.value, panel.notice.value
        assert not panel.branches and not (tmp_path / "branch").exists()
    finally:
        panel.close()
    assert not session.snapshot().edits, "a refused rate was recorded as an edit"


def test_the_terminal_edit_form_shows_the_sessions_refusal(tmp_path, sessions):
    from workbench.widgets.tui import DashboardApp
    from workbench.widgets.tui.forms import EditForm

    session = make_session(tmp_path / "run", callbacks=[Slow()])
    sessions.append(session)
    app = DashboardApp(session)

    async def main() -> None:
        async with app.run_test(size=(100, 32)) as pilot:
            async def until(condition, what: str) -> None:
                end = time.monotonic() + DEADLINE
                while not condition():
                    assert time.monotonic() < end, f"timed out waiting for {what}"
                    await pilot.pause(0.05)

            await until(lambda: session.snapshot().step >= 2, "a few steps")
            app.simulate_key("l")
            await until(lambda: isinstance(app.screen, EditForm) and app.screen.query("#edit-learning_rate"),
                        "the edit form, composed")
            form = app.screen
            for bad in BAD_RATES:
                form.query_one("#edit-learning_rate").value = str(bad)
                form.query_one("#edit-learning_rate").focus()
                app.simulate_key("enter")
                rule = f"learning_rate: {learning_rate_problem(bad)}"
                await until(lambda: str(form.query_one(".form-error").content) == rule, f"the refusal of {bad}")
                assert app.screen is form, "a refused edit keeps the form open"
            app.simulate_key("escape")
            await until(lambda: app.screen is app.dashboard, "the form to close")

    asyncio.run(main())
    assert not session.snapshot().edits, "a refused rate reached the session"


# --------------------------------------------------------------------------- branching


def test_branching_into_the_parents_folder_is_refused_by_the_api_and_the_panel(tmp_path, sessions):
    pytest.importorskip("ipywidgets")
    from workbench.widgets.notebook import Panel

    out = tmp_path / "run"
    session = finished_run(out, sessions, max_steps=20, save_strategy="steps", save_steps=10)
    ckpt = out / "checkpoint-10"
    before = sorted(p.name for p in out.iterdir())

    for target in (out, out / "x" / "..", f"{out}/"):  # the same folder, however it is written
        with pytest.raises(ValueError, match="is this run's own output_dir; a branch needs a folder of its own"):
            session.branch(ckpt, target, learning_rate=1e-3)
    held = tmp_path / "held"
    held.mkdir()
    shutil.copytree(ckpt, held / "checkpoint-10")
    with pytest.raises(ValueError, match=r"is not empty \(it holds checkpoint-10\); a branch needs a new or empty"):
        session.branch(ckpt, held)
    for overrides, message in (({"learning_rate": "fast"}, "learning_rate: expected a number"),
                               ({"no_such_argument": 1}, "no_such_argument: unknown key"),
                               ({"max_steps": 2.5}, "max_steps: expected an integer")):
        with pytest.raises(ValueError, match=message):
            session.branch(ckpt, tmp_path / "never", **overrides)
    with pytest.raises(ValueError, match="output_dir: the branch's folder is its own argument"):
        session.parse_overrides("warmup_steps=2, output_dir=elsewhere")
    with pytest.raises(ValueError, match="not a checkpoint"):
        session.branch(out / "checkpoint-7", tmp_path / "never")
    assert not (tmp_path / "never").exists(), "a refused branch created its folder"
    assert sorted(p.name for p in out.iterdir()) == before, "a refused branch wrote into the parent"

    panel = Panel(session, autostart=False)
    try:
        panel.checkpoint_select.value = str(ckpt)
        panel.branch_dir.value = str(out)
        panel.branch_button.click()
        assert 'data-level="error"' in panel.notice.value and "own output_dir" in panel.notice.value
        assert not panel.branches and not panel.branch_box.children
    finally:
        panel.close()
    # What the checks let through still branches (into a folder of its own).
    branch = session.branch(ckpt, tmp_path / "branch", learning_rate=1e-3)
    assert isinstance(branch, SessionLike) and branch.arguments()["learning_rate"] == 1e-3


# --------------------------------------------------------------------------- deleting checkpoints


class FirstIsBest:
    """compute_metrics that makes the first evaluation the best (greater is better, and it
    only goes down): the best checkpoint is then the oldest, not the newest."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, prediction) -> dict[str, float]:
        self.calls += 1
        return {"order": -float(self.calls)}


def test_delete_through_the_session_refuses_the_best_the_newest_and_the_one_in_use(tmp_path, sessions):
    pytest.importorskip("ipywidgets")
    from workbench.widgets.notebook import Panel

    out = tmp_path / "run"
    session = finished_run(out, sessions, max_steps=40, save_strategy="steps", save_steps=10, eval_strategy="steps",
                           eval_steps=10, metric_for_best_model="order", greater_is_better=True,
                           compute_metrics=FirstIsBest())
    rows = session.checkpoints
    assert all(isinstance(r, CheckpointRow) for r in rows)
    assert [(r.name, r.best, r.protected) for r in rows] == [
        ("checkpoint-10", True, True), ("checkpoint-20", False, False), ("checkpoint-30", False, False),
        ("checkpoint-40", False, True)]

    with pytest.raises(ValueError, match="checkpoint-10 is protected .the best checkpoint."):
        session.delete_checkpoint("checkpoint-10")
    with pytest.raises(ValueError, match="checkpoint-40 is protected .the newest complete checkpoint."):
        session.delete_checkpoint("checkpoint-40")
    with pytest.raises(ValueError, match="no checkpoint-99"):
        session.delete_checkpoint("checkpoint-99")
    with pytest.raises(ValueError, match="expected a checkpoint name"):
        session.delete_checkpoint(str(out / "checkpoint-20"))

    # A session about to resume from checkpoint-20 is using it.
    resuming = Session(make_session(out, max_steps=40).trainer, resume_from_checkpoint=str(out / "checkpoint-20"))
    with pytest.raises(ValueError, match="checkpoint-20 is in use"):
        resuming.delete_checkpoint("checkpoint-20")
    assert (out / "checkpoint-20").is_dir()

    _, cursor = session.events_since(0)
    session.delete_checkpoint("checkpoint-20")
    assert not (out / "checkpoint-20").exists()
    assert [r.name for r in session.checkpoints] == [r.name for r in session.snapshot().checkpoints] == [
        "checkpoint-10", "checkpoint-30", "checkpoint-40"]
    events, _ = session.events_since(cursor)
    assert [(e.kind, e.data) for e in events] == [("deleted", {"checkpoint": "checkpoint-20"})]
    assert [e["checkpoint"] for e in read_events(out) if e["event"] == "delete"] == ["checkpoint-20"]

    # The notebook panel deletes through the session, and shows its refusals.
    panel = Panel(session, autostart=False)
    try:
        panel.checkpoint_select.value = str(out / "checkpoint-40")
        panel.delete_button.click()
        assert 'data-level="error"' in panel.notice.value and "is protected" in panel.notice.value
        panel.checkpoint_select.value = str(out / "checkpoint-30")
        panel.delete_button.click()
        assert "deleted checkpoint-30" in panel.notice.value
        assert not (out / "checkpoint-30").exists()
        assert [Path(v).name for _, v in panel.checkpoint_select.options] == ["checkpoint-10", "checkpoint-40"]
    finally:
        panel.close()


def test_snapshots_carry_plain_data_only(tmp_path, sessions):
    session = finished_run(tmp_path, sessions, max_steps=10, save_strategy="steps", save_steps=10)
    snap = session.snapshot()
    assert isinstance(snap, Snapshot)
    plain = (str, int, float, bool, type(None), tuple, list, dict)

    def check(value, where: str) -> None:
        if hasattr(value, "to_dict"):  # the door's value types (rows, memory readings)
            value = value.to_dict()
        assert isinstance(value, plain), f"{where}: {type(value).__name__} is not plain data"
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (tuple, list)) else ()
        for key, item in items:
            check(item, f"{where}[{key!r}]")

    for name in snap.__dataclass_fields__:
        check(getattr(snap, name), name)
    check(session.arguments(), "arguments()")
    check(session.memory(), "memory()")
    report = session.inspect()
    check(report, "inspect()")
    assert report["can_sample"] is False  # an MLP classifier has nothing to sample
