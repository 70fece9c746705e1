"""A long run, attached: ``series`` round trips at 2,000 points, and the CPU an attached
dashboard (``workbench attach OUTDIR``, the Textual app in a real terminal: tmux) uses.

The run is a live Session in this process, training a small MLP with ``logging_steps=1``
(so its curves change before every refresh of the dashboard: the worst case). For the
"1M steps" rows its series first take 1,000,000 synthetic log points (steps -1,000,000 to
-1, through the Session's own SeriesStore: a real 1M-step run is too slow here), which
leaves them at their bound of ~2,000 points each with a million steps of history.

* ``series(points=2000)`` is timed from a client process (benchmarks/_control_client.py)
  over the real Unix socket: median, p95, max over ``--samples`` calls.
* The dashboard's CPU: utime+stime of its process from /proc/PID/stat over ``--seconds``,
  after it has drawn its first screen, as % of one core. Rows alternate (fresh run, 1M
  steps, 1M steps, fresh run, ...); medians with [min-max]. ``--dashboard EXE`` (repeat it)
  attaches with another checkout's CLI, e.g. main's ``.venv/bin/workbench``: before and
  after side by side against the same live run code, the rows alternating.

Results (2026-12-01, 2-core VM shared with other agents: load average 2.1-2.4; the run
at ~250 steps/s, so ~250 events/s):

  series(points=2000), 3 series of 1,477 points, 100 calls: median 21.8 ms, p95 27.8 ms
      (another run the same day, heavier load: median 44.9 ms, p95 129 ms; the run's
      training thread holds the GIL, so each of the request's steps waits for it)
  attached dashboard, 30 s x 3, % of one core, before (bf467ef) vs this version, one invocation:
      fresh run  9.1 [7.7-9.6] -> 4.1 [3.7-4.1];  1M steps  7.4 [7.4-7.5] -> 4.2 [4.2-4.2]
      (another invocation, 30 s x 2, load 2.5-3.8: 9.4 -> 4.2 and 7.3 -> 4.1)
  Then the attached poll at 3 Hz instead of 4 (widgets/tui/app.py POLL_ATTACHED), side by
  side in one invocation (30 s x 3, load ~1-2): fresh run 3.9 [3.6-4.0] vs 4.0 [3.9-4.4],
  1M steps 3.9 [3.7-4.1] vs 4.1 [4.0-4.2]; series(points=2000) median 12.3 ms, p95 13.2 ms.
  What made the difference (py-spy of the whole process, instrumented runs):
  - the event bridge posted one Textual message per event (~240 a second, each waking the
    app's loop): one per poll now (~1.5 points);
  - the charts were held to 2.5% of a core by their figure build only; the strips made
    from it cost a quarter more, and an attached dashboard now gets 1% (a redraw every
    ~7 s here, at most 10 s);
  - a fresh run's series deltas carried the whole recent window (~40 kB a poll, its JSON
    decode a fifth of the dashboard's CPU) once the history kept every 2nd+ point: the
    few points that age into it now come as inserted points (~5 kB);
  - chart_interval() ran a CSS query over the whole screen every poll.
  Left: ~1.5% is Textual repainting the progress line at the 4 Hz poll (compositor and
  terminal writes), ~1% the charts, ~1% Textual's own loop and threads; the event
  bridge's 10 Hz round trips plus the decoding of every logged event ~0.3-0.8% (without
  the bridge at all: 0.5-1.1 points less, two pairs of runs). A subscription stream would
  save the requests but not the decoding, so the bridge still polls.

Usage: python benchmarks/attach_scale.py [--seconds S] [--repeats R] [--samples N] [--dashboard EXE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from workbench import Session, Trainer, TrainingArguments
from workbench.data.builtin import load_builtin_data
from workbench.models import MLPClassifier
from workbench.train.callbacks import PrinterCallback

CLIENT = str(Path(__file__).with_name("_control_client.py"))
TICKS = os.sysconf("SC_CLK_TCK")


def live_run(train, out: str, prefill: int) -> Session:
    """A started Session logging every step; ``prefill`` synthetic points first fill its series."""
    torch.manual_seed(0)
    args = TrainingArguments(out, max_steps=10**8, per_device_train_batch_size=32, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True)
    trainer = Trainer(model=MLPClassifier(in_features=32, hidden=64, num_classes=4, n_layer=2), args=args,
                      train_dataset=train)
    trainer.remove_callback(PrinterCallback)
    session = Session(trainer)
    for i in range(prefill):  # benchmark-only: a long run's curves, without running it
        session._series.add_log(i - prefill, {"loss": 2.0 / (1 + i / 1000), "learning_rate": 1e-3 * (1 - i / prefill),
                                              "grad_norm": 0.5 + (i % 7) / 10})
    return session.start()


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def dashboard_cpu(out: str, seconds: float, name: str, exe: str) -> float:
    """% of one core used by ``exe attach out`` (a workbench CLI) in a 110x32 tmux pane over ``seconds``."""
    tmux("new-session", "-d", "-s", name, "-x", "110", "-y", "32", f"OMP_NUM_THREADS=1 exec {exe} attach {out}")
    try:
        pid = int(tmux("display-message", "-p", "-t", name, "#{pane_pid}").strip())
        deadline = time.monotonic() + 120
        while "RUNNING" not in tmux("capture-pane", "-p", "-t", name):
            if time.monotonic() > deadline:
                raise RuntimeError("the attached dashboard did not show the run:\n" + tmux("capture-pane", "-p", "-t", name))
            time.sleep(0.2)
        time.sleep(3.0)  # past its first full draw
        cpu, wall = cpu_seconds(pid), time.monotonic()
        time.sleep(seconds)
        return (cpu_seconds(pid) - cpu) / (time.monotonic() - wall) * 100
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)


def series_round_trips(out: str, samples: int) -> dict:
    reply = subprocess.run([sys.executable, CLIENT, "series", out, "--samples", str(samples)], capture_output=True,
                           text=True)
    if reply.returncode:
        raise RuntimeError(f"the series client failed:\n{reply.stderr}")
    return json.loads(reply.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--prefill", type=int, default=1_000_000)
    parser.add_argument("--dashboard", action="append", metavar="EXE",
                        help="a workbench CLI to attach with (repeat to compare, e.g. another checkout's "
                             ".venv/bin/workbench; the rows alternate); default: this one's")
    ns = parser.parse_args()
    exes = ns.dashboard or [str(Path(sys.executable).with_name("workbench"))]
    if shutil.which("tmux") is None:
        sys.exit("attach_scale: needs tmux (apt-get install tmux)")
    torch.set_num_threads(1)
    train, _ = load_builtin_data("random-classification", n_train=8192)
    runs = {"fresh run": 0, f"{ns.prefill:,} steps logged": ns.prefill}
    # One row per (run, dashboard): with several dashboards the label names each by its checkout.
    rows = {(f"{run}, {Path(exe).resolve().parents[2].name}" if len(exes) > 1 else run): (prefill, exe)
            for run, prefill in runs.items() for exe in exes}
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ns.repeats):
            order = list(rows) if i % 2 == 0 else list(rows)[::-1]
            for name in order:
                out = tempfile.mkdtemp(dir=tmp)
                prefill, exe = rows[name]
                session = live_run(train, out, prefill)
                try:
                    if prefill and i == 0 and exe == exes[0]:
                        series = series_round_trips(out, ns.samples)
                        print(f"series(points=2000) round trip, {name}, from a client process: median "
                              f"{series['median_ms']:.1f} ms, p95 {series['p95_ms']:.1f} ms, max {series['max_ms']:.1f} "
                              f"ms ({series['points']} points per series, {len(series['names'])} series)", flush=True)
                    cpu[name].append(dashboard_cpu(out, ns.seconds, f"wb-bench-{os.getpid()}-{i}", exe))
                    print(f"  {name}: dashboard {cpu[name][-1]:.1f}% of a core; run at step {session.snapshot().step}",
                          flush=True)
                finally:
                    session.stop(save=False)
                    session.wait()
                    session.close()
    print(f"attached dashboard, % of one core over {ns.seconds:g} s (logging every step), median [min-max]:")
    for name, values in cpu.items():
        print(f"  {name:<44} {statistics.median(values):5.1f}% [{min(values):.1f}-{max(values):.1f}]")


if __name__ == "__main__":
    main()
