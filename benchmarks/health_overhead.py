"""Per-step cost of run health (issue 27), side by side: the time ledger, the throughput
counters and the health watchdog on (the default) against all of them off, on the overhead
benchmark's MLP (overhead-bound: a step is about a millisecond, so any per-step cost shows).
Target: a ratio >= 0.99.

"off" swaps the Trainer's ledger for one whose phase switches do nothing, its throughput
counter for one that counts nothing, and sets ``hang_timeout = 0`` (no watchdog thread) and
``oom_retries = 0``; "on" is what every run does. Rows alternate over the repetitions.

With ``--processes 2`` the rows run on 2 CPU ranks (gloo, started through the launcher as
``workbench run --num-processes 2`` starts them), with a third row: the out-of-memory
agreement's per-step store look-up (distributed/oom_flags.py) forced on with
``WORKBENCH_OOM_AGREEMENT=1``, as it runs on accelerators (CPU ranks leave it off: torch
raises no OutOfMemoryError there).

Then the time from a hang to its report and to the stack dump: a one-process run whose data
loader stops, with ``hang_timeout`` 2 s and the watchdog's once-a-second look (median of
``--repeats``).

Usage: python benchmarks/health_overhead.py [--steps N] [--repeats R] [--processes P]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _timing import print_table, round_robin
from overhead import _check_steps, _workbench_trainer, mlp_workload

from workbench import Trainer, TrainingArguments
from workbench.core.ledger import Ledger
from workbench.data.builtin import load_builtin_data
from workbench.distributed.health import Health
from workbench.models import MLPClassifier
from workbench.train.throughput import Throughput


class OffLedger(Ledger):
    """A ledger whose phase switches do nothing (the "off" row)."""

    def enter(self, phase: str) -> str:
        return phase

    def step_done(self, step: int, compute_seconds: float) -> None:
        self.step = step


class OffThroughput(Throughput):
    def add(self, inputs, samples, flos) -> None:
        pass


OFF, ON, AGREEING = "health off", "health on (default)", "on + OOM agreement"


def run(work, steps: int, out: str, on: bool | str) -> float:
    """Steps/s of one run: ``on`` True (the default), False (all off) or a row's name."""
    import os

    if on == AGREEING:
        os.environ["WORKBENCH_OOM_AGREEMENT"] = "1"  # read as the loop sets up (train/oom.py)
    on = {OFF: False, ON: True}.get(on, on) if isinstance(on, str) else on
    trainer, watch = _workbench_trainer(work, steps, out)
    if on is False:
        trainer.ledger, trainer.throughput = OffLedger(), OffThroughput()
        trainer.health = Health(hang_timeout=0, oom_retries=0)
    with watch:
        trainer.train()
    os.environ.pop("WORKBENCH_OOM_AGREEMENT", None)
    _check_steps("workbench Trainer", trainer.state.global_step, steps)
    return steps / watch.loop


class Stuck:
    """A collator that stops for ``seconds`` at its 5th batch and notes when it began."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls, self.began = seconds, 0, 0.0

    def __call__(self, rows):
        self.calls += 1
        if self.calls == 5:
            self.began = time.time()
            time.sleep(self.seconds)
        return {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in rows[0]}


def hang_latency(out: str, timeout: float = 2.0) -> tuple[float, float]:
    """(seconds from the stall to the hang record, to the stack file) of one run."""
    train, _ = load_builtin_data("random-classification", n_train=256, n_eval=8, in_features=8, num_classes=3)
    stuck = Stuck(timeout + 3.0)
    args = TrainingArguments(out, max_steps=6, per_device_train_batch_size=8, report_to="none", disable_tqdm=True,
                             save_strategy="no")
    trainer = Trainer(model=MLPClassifier(in_features=8, hidden=8, num_classes=3), args=args, train_dataset=train,
                      data_collator=stuck, health=Health(hang_timeout=timeout))
    trainer.train()
    record = next(json.loads(line) for line in Path(out, "events.jsonl").read_text().splitlines()
                  if json.loads(line)["event"] == "hang")
    dumped = Path(record["folder"], "rank-0.txt").stat().st_mtime
    return record["time"] - stuck.began, dumped - stuck.began


def rank_main(opts: argparse.Namespace) -> None:
    """One rank of ``--processes``: every row once per repetition (the order alternates; the
    first repetition warms up); rank 0 writes the steps/s."""
    import torch.distributed as dist
    from accelerate import PartialState

    PartialState()  # joins the launcher's process group (the Trainers reuse it)
    work, rows = mlp_workload(), (OFF, ON, AGREEING)
    results: dict[str, list[float]] = {name: [] for name in rows}
    for repeat in range(opts.repeats + 1):
        for name in rows if repeat % 2 else reversed(rows):
            dist.barrier()
            rate = run(work, opts.steps, opts.out, name)
            if repeat:
                results[name].append(rate)
    if dist.get_rank() == 0:
        Path(opts.out, "health_ranks.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def launch_ranks(opts: argparse.Namespace) -> int:
    """Start ``opts.processes`` CPU ranks running this script, then print rank 0's table."""
    import os
    import subprocess

    from workbench.distributed.launch import launcher_command

    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as out:
        args = [__file__, "--repeats", str(opts.repeats), "--steps", str(opts.steps), "--out", out]
        command, env = launcher_command(opts.processes, args)
        env.update(PYTHONPATH=os.pathsep.join([str(repo), str(repo / "benchmarks")]), OMP_NUM_THREADS="1",
                   ACCELERATE_USE_CPU="1")
        result = subprocess.run(command, env=env)
        if result.returncode:
            return result.returncode
        rates = json.loads(Path(out, "health_ranks.json").read_text())
    print_table(f"MLP, {opts.steps} steps, {opts.processes} CPU ranks (gloo), {opts.repeats} repeats alternating",
                rates, baseline=OFF)
    return 0


def main() -> int:
    import os

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # set for the ranks
    opts = parser.parse_args()
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:
        rank_main(opts)
        return 0
    if opts.processes > 1:
        return launch_ranks(opts)
    work = mlp_workload()
    with tempfile.TemporaryDirectory() as tmp:
        run(work, 100, tmp, True)
        run(work, 100, tmp, False)  # warm-up
        rates = round_robin({OFF: lambda: run(work, opts.steps, tmp, False),
                             ON: lambda: run(work, opts.steps, tmp, True)}, opts.repeats)
        print_table(f"{work.title}, {opts.steps} steps x {opts.repeats}", rates, baseline=OFF)
        latencies = [hang_latency(str(Path(tmp) / f"hang-{i}")) for i in range(3)]
    report = statistics.median(t for t, _ in latencies)
    dump = statistics.median(d for _, d in latencies)
    print(f"\na hang (hang_timeout 2 s): reported {report:.1f} s after the stall began, stacks written at {dump:.1f} s "
          f"(median of {len(latencies)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
