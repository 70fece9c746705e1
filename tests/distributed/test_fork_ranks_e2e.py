"""A/B forks with several processes (``workbench run --num-processes 2``, DDP on 2 CPU ranks),
steered over the control endpoint as an agent would: pause, fork two variants, keep one (or
discard the fork), resume. Every rank forks in step with rank 0 (the paused ranks' heartbeat
carries the order), so the run neither hangs nor lets the replicas drift apart: both ranks
end with the very same weights, the fork's variants trained on the same batches, and the
kept variant's change is the run's live edit."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.processes import start_workbench

from workbench.checkpoint.store import CheckpointStore
from workbench.control.client import attach
from workbench.core.event_file import read_events

pytestmark = pytest.mark.slow

CONFIG = """\
[model]
builtin = "mlp"
[model.options]
in_features = 8
hidden = 16
num_classes = 3
[data]
builtin = "random-classification"
[data.options]
n_train = 2048
n_eval = 64
in_features = 8
num_classes = 3
[training]
output_dir = "out"
max_steps = 200
per_device_train_batch_size = 8
per_device_eval_batch_size = 16
learning_rate = 0.01
logging_steps = 5
save_steps = 100
report_to = "jsonl"
disable_tqdm = true
[hooks]
data_collator = "ranks:collate"
callbacks = ["ranks:WeightsAtEnd"]
"""

RANKS_PY = """\
import hashlib, os, time
from torch.utils.data import default_collate
from workbench import TrainerCallback


def collate(rows):
    time.sleep(0.01)  # slow enough to pause mid-run
    return default_collate(rows)


class WeightsAtEnd(TrainerCallback):
    def on_train_end(self, args, state, control, model=None, **kwargs):
        digest = hashlib.sha1()
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(name.encode() + tensor.detach().cpu().numpy().tobytes())
        with open(os.path.join(args.output_dir, f"weights-rank{os.environ['RANK']}.txt"), "w") as f:
            f.write(f"{state.global_step} {digest.hexdigest()}")
"""


def _start(tmp_path: Path):
    (tmp_path / "ranks.py").write_text(RANKS_PY)
    (tmp_path / "run.toml").write_text(CONFIG)
    return start_workbench("run", "run.toml", "--headless", "--num-processes", "2", cwd=tmp_path)


def _paused_remote(tmp_path: Path, run) -> object:
    out = tmp_path / "out"
    deadline = time.monotonic() + 180
    while not (out / "control.json").exists() or not (out / "events.jsonl").exists():
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.2)
    remote = attach(out)
    while remote.snapshot().step < 10:
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.2)
    remote.pause(wait=True, timeout=60)
    return remote


def _finish(tmp_path: Path, run, remote) -> list[str]:
    remote.resume()
    assert run.wait(timeout=240) == 0, run.communicate()[1][-3000:]
    out = tmp_path / "out"
    return [(out / f"weights-rank{r}.txt").read_text() for r in (0, 1)]


def test_two_ranks_fork_keep_a_variant_and_stay_replicas(tmp_path):
    run = _start(tmp_path)
    try:
        remote = _paused_remote(tmp_path, run)
        paused_at = remote.snapshot().step
        cost = remote.fork_cost({"a": {}, "b": {}}, 6)
        assert cost["ranks"] == 2 and cost["bytes"] == 2 * 3 * cost["bytes_each"]  # both ranks' copies, one host
        report = remote.fork({"a": {}, "b": {"learning_rate": 0.05}}, steps=6)
        assert report["state"] == "done" and report["step"] == paused_at
        a, b = report["variants"]["a"], report["variants"]["b"]
        assert a["batches"] == b["batches"] and len(a["batches"]) == 6
        assert a["loss"] != b["loss"] and "eval_loss" in a["eval"] and "eval_loss" in report["parent"]["eval"]
        assert remote.snapshot().step == paused_at  # back at the pause on every rank
        # a saved on purpose (every rank writes its part), the fork still open: b is kept after it
        saved = remote.save_variant("a", str(tmp_path / "variant-a"))
        assert saved == str(tmp_path / "variant-a" / f"checkpoint-{paused_at + 6}")
        assert CheckpointStore(tmp_path / "variant-a").verify(saved) == (True, None)
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in Path(saved).iterdir()}
        kept = remote.keep("b", reason="the faster rate")
        assert "fork 1: kept b" in kept["reason"] and remote.snapshot().step == paused_at + 6
        rank0, rank1 = _finish(tmp_path, run, remote)
    finally:
        if run.poll() is None:
            run.kill()
    assert rank0 == rank1 and rank0.startswith("200 ")  # the replicas never drifted apart
    state = json.loads((tmp_path / "out" / "checkpoint-200" / "workbench_state.json").read_text())
    assert any(e.get("learning_rate") == 0.05 and "kept b" in e["reason"] for e in state["live_edits"])
    # The kept steps were logged by every rank at the logging points among them: no gap.
    logged = [e["step"] for e in read_events(tmp_path / "out") if e["event"] == "log" and "loss" in e]
    assert logged == list(range(5, 201, 5))
    assert not (tmp_path / "out" / f"checkpoint-{paused_at + 6}").exists()  # a's state stayed in its own folder
    # The saved variant resumes on 2 ranks in a run of its own and ends as replicas.
    again = start_workbench("run", "run.toml", "--headless", "--num-processes", "2", "--set",
                            "training.output_dir=variant-a", "--resume", cwd=tmp_path)
    assert again.wait(timeout=240) == 0, again.communicate()[1][-3000:]
    rank0, rank1 = [(tmp_path / "variant-a" / f"weights-rank{r}.txt").read_text() for r in (0, 1)]
    assert rank0 == rank1 and rank0.startswith("200 ")
    resumed = json.loads((tmp_path / "variant-a" / "checkpoint-200" / "workbench_state.json").read_text())
    assert "fork 1: saved a" in resumed["live_edits"][-1]["reason"]


def test_two_ranks_fork_and_discard_continue_from_the_pause(tmp_path):
    run = _start(tmp_path)
    try:
        remote = _paused_remote(tmp_path, run)
        paused_at = remote.snapshot().step
        remote.fork({"slow": {"learning_rate": 0.001}, "fast": {"learning_rate": 0.05}}, steps=4)
        remote.discard()
        assert remote.snapshot().step == paused_at and remote.snapshot().fork["state"] == "discarded"
        rank0, rank1 = _finish(tmp_path, run, remote)
    finally:
        if run.poll() is None:
            run.kill()
    assert rank0 == rank1 and rank0.startswith("200 ")
    state = json.loads((tmp_path / "out" / "checkpoint-200" / "workbench_state.json").read_text())
    assert not any("fork" in e.get("reason", "") for e in state["live_edits"])
