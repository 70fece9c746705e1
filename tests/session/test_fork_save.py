"""A fork's variant saved on purpose (issue 28): ``save_variant(name, folder)`` writes the
variant's end state as a checkpoint in a folder of its own while the run stays at the pause.
A run resumed from it goes on bitwise as the run that kept the variant goes on; the forked run
itself, its folder and its guard are untouched, and a discard after the save is still the
never-forked run. Real runs and Sessions, attached over the control endpoint too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_forks import COUNTED, PAUSE, STEPS, TOTAL, logged, output_files, run_to

from workbench import Guard, Session, attach
from workbench.checkpoint.store import CheckpointStore
from workbench.control.watch import RecordedRun
from workbench.core.event_file import read_events
from workbench.widgets.view import describe_event

from support import assert_same_weights, finish, wait_until
from support.sessions import make_trainer

VARIANTS = {"a": {}, "b": {"learning_rate": 1e-3}}
# Saves every 1000 steps: none inside the run, so the forked run's own folder is only its log.
SETTINGS = dict(COUNTED, save_strategy="steps", save_steps=1000)


def test_a_saved_variant_resumes_as_the_kept_variant_goes_on(tmp_path, sessions):
    kept = run_to(tmp_path / "kept", sessions, **SETTINGS)
    kept.fork(VARIANTS, steps=STEPS)
    kept.keep("b")
    kept.resume()
    assert finish(kept) == "finished"

    never = run_to(tmp_path / "never", sessions, pause=None, **SETTINGS)
    assert finish(never) == "finished"

    out, folder = tmp_path / "fork", tmp_path / "variant-b"
    session = run_to(out, sessions, **SETTINGS)
    report = session.fork(VARIANTS, steps=STEPS)
    before = output_files(out)
    edits_before = [dict(e) for e in session.trainer.workbench_state.live_edits]
    path = session.save_variant("b", folder, reason="for later")
    assert path == str(folder.resolve() / f"checkpoint-{PAUSE + STEPS}")
    assert CheckpointStore(folder).verify(path) == (True, None)  # complete, sealed, every hash right
    # The run is where it was: its step, its edits, its folder (but for the event saying so).
    assert session.snapshot().step == PAUSE and session.status == "paused"
    assert session.trainer.workbench_state.live_edits == edits_before
    after = output_files(out)
    assert {k: v for k, v in after.items() if k != "events.jsonl"} == {k: v for k, v in before.items()
                                                                       if k != "events.jsonl"}
    saved = [e for e in read_events(out) if e["event"] == "fork_saved"]
    assert [(e["variant"], e["path"]) for e in saved] == [("b", path)]
    # Said in the event log of every front-end: live, and by watch from events.jsonl.
    (live,) = [e for e in session.events_since(0)[0] if e.kind == "fork_saved"]
    line = ("good", f"step {PAUSE}: fork 1: variant b saved to {path}")
    assert describe_event(live.kind, live.step, live.data) == line
    (recorded,) = [e for e in RecordedRun(out).events_since(0)[0] if e.kind == "fork_saved"]
    assert describe_event(recorded.kind, recorded.step, recorded.data) == line
    assert session.snapshot().fork["saved"] == {"b": path} and session.snapshot().fork["state"] == "done"
    # The checkpoint names the fork in its edits: b's change, then the record of the save.
    state = json.loads((folder / f"checkpoint-{PAUSE + STEPS}" / "workbench_state.json").read_text())
    change, record = state["live_edits"]
    assert change["learning_rate"] == 1e-3 and change["step"] == PAUSE
    assert change["reason"].startswith(f"fork 1: saved b after {STEPS} steps from step {PAUSE} (eval_loss ")
    assert change["reason"].endswith("; for later") and record["reason"] == change["reason"]
    assert record["fork"] == {"id": 1, "saved": "b", "from_step": PAUSE, "steps": STEPS, "folder": str(folder.resolve())}
    assert report["variants"]["b"]["end_step"] == record["step"] == PAUSE + STEPS

    # Saving changed nothing of the fork: discard is still the run that never forked.
    session.discard()
    session.resume()
    assert finish(session) == "finished"
    assert_same_weights(never.model, session.model)
    assert logged(session) == logged(never)

    # The saved variant, resumed: the kept run's weights, counters and losses from there on.
    resumed = Session(make_trainer(folder, max_steps=TOTAL, eval_strategy="steps", eval_steps=20, **SETTINGS),
                      resume_from_checkpoint=True)
    sessions.append(resumed)
    assert finish(resumed.start()) == "finished"
    assert_same_weights(kept.model, resumed.model)
    assert resumed.trainer.state.total_flos == kept.trainer.state.total_flos > 0
    assert resumed.trainer.state.num_input_tokens_seen == kept.trainer.state.num_input_tokens_seen > 0
    # The first log after the variant (step 35) averages the variant's unlogged steps 29-30 with
    # the resumed ones: the loss window came with the checkpoint.
    def after_variant(session):
        return [e for e in logged(session) if "loss" in e and e["step"] > PAUSE + STEPS]

    assert after_variant(resumed) == after_variant(kept) != []
    # Its log history is the run's up to the pause, then its own: the variant's logs (21, 28) are
    # in the fork report, not in the checkpoint.
    assert [e["step"] for e in logged(resumed) if "loss" in e][:3] == [7, 14, 35]


def test_saving_a_variant_never_gives_the_guard_a_point_to_roll_back_to(tmp_path, sessions):
    guard = Guard(nonfinite="rollback", snapshot_every=5, snapshots=4)
    session = run_to(tmp_path / "fork", sessions, guard=guard, **SETTINGS)
    ring = session.trainer.loop.guard.ring
    points = [p.step for p in ring._ring]
    session.fork(VARIANTS, steps=STEPS)
    session.save_variant("b", tmp_path / "b")
    assert [p.step for p in ring._ring] == points and max(points) <= PAUSE
    session.discard()


def test_save_variant_is_refused_in_one_line_when_it_cannot_save(tmp_path, sessions):
    out = tmp_path / "fork"
    session = run_to(out, sessions)
    with pytest.raises(RuntimeError, match="save_variant: no fork whose variants are held"):
        session.save_variant("a", tmp_path / "a")
    session.fork(VARIANTS, steps=3, evaluate=False)
    with pytest.raises(ValueError, match="save_variant: no variant 'z'; the fork has a, b"):
        session.save_variant("z", tmp_path / "z")
    with pytest.raises(ValueError, match="is this run's own output_dir; a saved variant needs a folder of its own"):
        session.save_variant("a", out)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"save_variant: .*full is not empty \(it holds notes.txt\)"):
        session.save_variant("a", tmp_path / "full")
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine" and not (tmp_path / "z").exists()
    session.keep("a")
    with pytest.raises(RuntimeError, match="no fork whose variants are held"):  # keep dropped them
        session.save_variant("b", tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_save_variant_over_attach(tmp_path, sessions):
    session = run_to(tmp_path / "fork", sessions)
    remote = attach(tmp_path / "fork")
    try:
        remote.fork({"slow": {"learning_rate": 1e-4}, "fast": {"learning_rate": 5e-2}}, steps=5)
        with pytest.raises(ValueError, match="not empty"):
            remote.save_variant("fast", str(tmp_path))
        path = remote.save_variant("fast", str(tmp_path / "fast"), reason="compare later")
        assert path.endswith(f"checkpoint-{PAUSE + 5}") and CheckpointStore(tmp_path / "fast").verify(path)[0]
        remote.discard()
        assert remote.snapshot().step == PAUSE
    finally:
        remote.close()
    session.stop(save=False)
    finish(session)


def test_a_saved_lora_variant_is_an_adapter_checkpoint_that_resumes_as_kept(finetune_workspace, tmp_path, sessions):
    """A LoRA run's variant is saved as HF's Trainer saves a PEFT model's checkpoint (the
    adapter and its config, not the frozen base) and resumes to the kept variant's adapter."""
    pytest.importorskip("peft")
    import torch

    from workbench import Trainer
    from workbench.core.trainer_utils import unwrap_model
    from workbench.data.collators import DataCollatorForLanguageModeling

    from support.finetune import chat_lm_dataset, lora_model
    from support.runs import make_args
    from support.steering import PauseAt

    data, tokenizer = chat_lm_dataset(finetune_workspace.model)

    def paused(out, max_steps=12):
        pause = PauseAt(4)
        trainer = Trainer(model=lora_model(finetune_workspace.model, dropout=0.0),
                          args=make_args(out, max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-2,
                                         seed=0, use_cpu=True, save_strategy="no"),
                          train_dataset=data, data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                          callbacks=[pause])
        session = pause.session = Session(trainer)
        sessions.append(session.start())
        wait_until(lambda: session.status == "paused", "the pause at step 4")
        session.fork({"a": {}, "b": {"learning_rate": 3e-3}}, steps=3, evaluate=False)
        return session

    def adapter(session):
        return {n: p.detach().clone() for n, p in unwrap_model(session.model).named_parameters() if p.requires_grad}

    kept = paused(tmp_path / "kept")
    kept.keep("b")
    kept.resume()
    assert finish(kept) == "finished"

    session = paused(tmp_path / "fork")
    path = Path(session.save_variant("b"))
    assert path == (tmp_path / "fork").resolve().parent / "fork-fork1-b" / "checkpoint-7"
    files = {p.name for p in path.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= files
    assert "model.safetensors" not in files  # the frozen base stays out, as in every LoRA checkpoint
    session.discard()
    session.stop(save=False)
    finish(session)

    resumed = Trainer(model=lora_model(finetune_workspace.model, dropout=0.0),
                      args=make_args(path.parent, max_steps=12, per_device_train_batch_size=4, learning_rate=1e-2,
                                     seed=0, use_cpu=True, save_strategy="no"),
                      train_dataset=data, data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    resumed.train(resume_from_checkpoint=str(path))
    ours, theirs = adapter(kept), {n: p.detach() for n, p in unwrap_model(resumed.model).named_parameters()
                                   if p.requires_grad}
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
