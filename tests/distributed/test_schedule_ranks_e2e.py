"""Schedule edits with two processes (issue 28): rank 0's Session reshapes the schedule, while
paused and while training, and both ranks train every step with the same learning rate and
keep the same records; the cooldown ends the run on both at the same step."""

from __future__ import annotations

import json
import subprocess

from workbench.distributed.launch import launcher_command

from support import subprocess_env
from test_multiprocess import write_config

_SCRIPT = r'''
import json, sys, time
from pathlib import Path
from workbench import TrainerCallback
from workbench.config.build import build_trainer
from workbench.config.loader import load_config
from workbench.session.local import Session

out = Path(sys.argv[1])
run = load_config(sys.argv[2], ["training.max_steps=300", "training.eval_strategy=no", "training.save_strategy=no"])
trainer = build_trainer(run)
rank = trainer.accelerator.process_index
seen = {"lr": []}

class Record(TrainerCallback):
    def on_optimizer_step(self, args, state, control, **kwargs):
        seen["lr"].append([state.global_step + 1, trainer.optimizer.param_groups[0]["lr"]])

trainer.add_callback(Record())
session = Session(trainer)
session.start()
report = {}
if rank == 0:
    while session.snapshot().step < 8:
        time.sleep(0.01)
    session.pause(wait=True, timeout=60)
    report["paused_at"] = session.snapshot().step
    report["extend"] = session.extend(400, reason="train longer")
    session.resume()
    report["decay"] = session.decay_now(30, shape="cosine", reason="cool down").result(timeout=120)
report["status"] = session.wait()
report["step"] = trainer.state.global_step
report["live_edits"] = trainer.workbench_state.live_edits
report.update(seen)
(out / f"rank{rank}.json").write_text(json.dumps(report))
trainer.accelerator.wait_for_everyone()
import torch.distributed as dist
if dist.is_initialized():
    dist.destroy_process_group()
'''


def test_schedule_edits_from_rank_0_apply_on_both_ranks_at_the_same_step(tmp_path):
    script = tmp_path / "schedule_ranks.py"
    script.write_text(_SCRIPT)
    config = write_config(tmp_path, "out")
    command, env = launcher_command(2, [str(script), str(tmp_path), str(config)])
    result = subprocess.run(command, capture_output=True, text=True, env={**env, **subprocess_env()}, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    zero, one = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert zero["status"] == one["status"] == "finished"
    decay_at = zero["decay"]["schedule"]["at"]
    assert zero["step"] == one["step"] == decay_at + 30  # the cooldown ended the run on both ranks
    assert zero["extend"]["schedule"]["at"] == zero["paused_at"]
    assert zero["live_edits"] == one["live_edits"]
    assert [e["schedule"]["op"] for e in zero["live_edits"]] == ["extend", "decay_now"]
    assert zero["lr"] == one["lr"]  # bit for bit: every step on both ranks
    lr = dict((int(s), v) for s, v in zero["lr"])
    # No jump at either edit; the cooldown goes down to 0.
    for at in (zero["paused_at"], decay_at):
        assert abs(lr[at + 1] - lr[at]) < 0.05 * lr[at]
    assert lr[decay_at + 30] < 0.01 * lr[decay_at + 1]
