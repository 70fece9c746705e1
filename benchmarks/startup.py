"""Start-up and whole-run cost of ``workbench run`` vs a plain PyTorch script, side by side.

Both train the demo's tiny GPT on the built-in python-source data for 300 steps (batch
16 x 128 tokens, AdamW, linear decay, clipping at 1.0, a loss print every 100 steps, no
evaluation, no checkpoints): the plain script by hand, workbench through ``workbench run
CONFIG --headless``. Each is a fresh process; the runs alternate. Reported (medians):
total wall time, time from process start to the first optimizer step, peak RSS.

Usage: python benchmarks/startup.py [--repeats R] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFIG = """\
run_name = "startup"
[model]
builtin = "tiny-gpt"
[model.options]
n_layer = 2
n_head = 4
n_embd = 128
[data]
builtin = "python-source"
[data.options]
block_size = 128
max_chars = 400000
[training]
output_dir = "{out}"
max_steps = {steps}
per_device_train_batch_size = 16
learning_rate = 3e-3
lr_scheduler_type = "linear"
logging_steps = 100
save_strategy = "no"
report_to = "none"
seed = 42
"""

# What a careful person writes by hand for the same run (the model and data come from
# workbench's model zoo and data module, which are not the framework under test).
PLAIN = r'''
import sys, time
import torch
from torch.utils.data import DataLoader
from workbench.data.builtin import load_builtin_data
from workbench.models import TinyGPT

steps = int(sys.argv[1])
torch.manual_seed(42)
train, _ = load_builtin_data("python-source", block_size=128, max_chars=400000)
model = TinyGPT(vocab_size=99, n_layer=2, n_head=4, n_embd=128, block_size=128)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (steps - s) / steps))
loader = DataLoader(train, batch_size=16, shuffle=True)
done, first = 0, None
while done < steps:
    for batch in loader:
        loss = model(**batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        done += 1
        if first is None:
            first = time.time()
        if done % 100 == 0:
            print(f"step {done} loss {loss.item():.4f}", flush=True)
        if done == steps:
            break
print(f"FIRST_STEP {first}")
'''


def _run(command: list[str], env: dict[str, str]) -> tuple[float, float, str, float]:
    """(wall seconds, peak RSS MiB, stdout, start time) of one fresh process."""
    start = time.time()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{command} failed")
    return wall, usage.ru_maxrss / 1024, out, start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    ns = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    tmp = Path(tempfile.mkdtemp(prefix="workbench-startup-"))
    script = tmp / "plain.py"
    script.write_text(PLAIN)
    out = tmp / "out"
    config = tmp / "run.toml"
    config.write_text(CONFIG.format(out=out, steps=ns.steps))
    rows: dict[str, dict[str, list[float]]] = {name: {"wall": [], "first": [], "rss": []}
                                               for name in ("plain script", "workbench run")}
    for _ in range(ns.repeats):
        wall, rss, text, start = _run([sys.executable, str(script), str(ns.steps)], env)
        first = float(text.rsplit("FIRST_STEP ", 1)[1])
        rows["plain script"]["wall"].append(wall)
        rows["plain script"]["first"].append(first - start)
        rows["plain script"]["rss"].append(rss)
        wall, rss, _, start = _run([sys.executable, "-m", "workbench", "run", str(config), "--headless",
                                    "--overwrite"], env)
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        begin = [e["time"] for e in events if e["event"] == "start"][-1]  # this run's (the log appends)
        rows["workbench run"]["wall"].append(wall)
        rows["workbench run"]["first"].append(begin - start)
        rows["workbench run"]["rss"].append(rss)
    med = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in rows.items()}
    base = med["plain script"]
    print(f"{ns.steps}-step tiny-GPT run, {ns.repeats} fresh processes each, alternating (median)")
    print(f"{'':<15} {'total wall':>11} {'ratio':>6} {'to training':>12} {'peak RSS':>10} {'extra':>9}")
    for name, m in med.items():
        print(f"{name:<15} {m['wall']:>9.1f} s {m['wall'] / base['wall']:>6.2f} {m['first']:>10.2f} s "
              f"{m['rss']:>6.0f} MiB {m['rss'] - base['rss']:>+5.0f} MiB")
    print("('to training': process start to the first optimizer step for the plain script, to the "
          "run's start event, just before the first step, for workbench)")


if __name__ == "__main__":
    main()
