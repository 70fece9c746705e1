"""Per-step cost of the guard (issue #18), side by side: the workbench Trainer with the
guard off and on, on the overhead benchmark's workloads (MLP: overhead-bound; tiny GPT:
compute-bound), same arguments otherwise (fused AdamW, clipping, a log every 50 steps).

"guard on" watches both non-finite and spiking losses (nonfinite="skip", spike="skip").
On these CPU runs the steps are judged on the host (float arithmetic, a bad step's optimizer
step left out: train/guard_checks.py); the row "guard on, device checks" forces the
accelerator path instead (a few small device ops: a running median, one found_inf flag for
the fused optimizer, no host sync), which is what a GPU run does and what CPU runs did
before. The target is a ratio >= 0.98.

Results (2026-12-01, 2-core VM shared with one other agent, load ~1.5-1.9; MLP 1500 steps
x 7 repeats, round robin): guard on 0.990 of guard off (CPU 2655 vs 2672 µs a step: no
measurable cost), device checks 0.925 (2873 µs); snapshot 0.98 ms vs synchronous save
17.7 ms. Tiny GPT, 30 steps x 5: guard on 1.04, device checks 1.04 (compute-bound: noise);
snapshot 2.8 ms vs save 50.3 ms.

Then, for rollback, the time training is blocked per in-memory snapshot (host copies of
weights, optimizer, schedule and RNG: guard/ring.py) side by side with a
synchronous checkpoint save (copies plus writing, hashing and publishing the files), on
the same trained model.

With ``--processes 2`` the same rows run on 2 CPU ranks (gloo, started through the
launcher like ``workbench run --num-processes 2``): what the guard's agreement across ranks
costs per step (the two flags all-reduced before every optimizer step, so that every rank
skips the same step; distributed/guard_flags.py). The row "guard on, no agreement" leaves
that all-reduce out (unsafe, for comparison only: it shows the all-reduce's share). Rows
alternate within the run on both ranks; rank 0 prints.

Usage: python benchmarks/guard_overhead.py [--steps N] [--repeats R] [--workload mlp|lm|all] [--processes P]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
from _timing import print_table, round_robin
from overhead import _check_steps, _workbench_trainer, lm_workload, mlp_workload

import statistics
import time

from workbench import Guard

GUARD_ON = Guard(nonfinite="skip", spike="skip")


def trainer_run(work, steps: int, out: str, guard: Guard | None, on_host: bool = True):
    from workbench.guard import checks as guard_checks

    trainer, watch = _workbench_trainer(work, steps, out)
    trainer.guard = guard
    guard_checks.HOST_DECIDES_ON_CPU = on_host
    try:
        with watch:
            trainer.train()
    finally:
        guard_checks.HOST_DECIDES_ON_CPU = True
    _check_steps("workbench Trainer", trainer.state.global_step, steps)
    return watch


def blocked_ms(work, out: str, repeats: int) -> dict[str, list[float]]:
    """Milliseconds one snapshot and one synchronous save block the loop, ``repeats`` each
    (alternating, after a short run so the optimizer state exists)."""
    from workbench.guard.ring import RollbackPoint
    from workbench.checkpoint.trainer_state import save_checkpoint

    trainer, _ = _workbench_trainer(work, 5, out)
    trainer.args.save_async = False
    trainer.args.save_total_limit = 1  # keep the disk use of the repeats to one checkpoint
    trainer.train()
    times: dict[str, list[float]] = {"in-memory snapshot": [], "synchronous save": []}
    for _ in range(repeats):
        start = time.perf_counter()
        RollbackPoint.take(trainer, {})
        times["in-memory snapshot"].append(1e3 * (time.perf_counter() - start))
        trainer.state.global_step += 1  # a new checkpoint name each time
        start = time.perf_counter()
        save_checkpoint(trainer)
        times["synchronous save"].append(1e3 * (time.perf_counter() - start))
    return times


def print_blocked(title: str, times: dict[str, list[float]]) -> None:
    base = statistics.median(times["synchronous save"])
    print(title)
    print(f"{'blocked':<20} {'median ms':>10} {'min':>8} {'max':>8} {'vs save':>8}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:<20} {med:>10.2f} {min(values):>8.2f} {max(values):>8.2f} {med / base:>8.2f}")


MAKERS = {"mlp": mlp_workload, "lm": lm_workload}
ROWS = {"guard off": None, "guard on": GUARD_ON}
# The accelerator path (device ops, found_inf) forced on the CPU, for comparison: what the
# guard cost on CPU runs before they judged their steps on the host.
DEVICE_ROW = "guard on, device checks"
UNAGREED = "guard on, no agreement"
RANK_ROWS = {**ROWS, UNAGREED: GUARD_ON}


def rank_main(opts: argparse.Namespace) -> None:
    """One rank of ``--processes``: every row once per repetition on every rank (the order
    alternates; the first repetition warms up); rank 0 writes steps/s and CPU µs per step."""
    import torch.distributed as dist
    from accelerate import PartialState

    PartialState()  # joins the process group the launcher set up (the Trainers reuse it)
    results: dict[str, list[list[float]]] = {}
    for key in _workload_keys(opts):
        work = MAKERS[key]()
        steps = opts.steps or work.steps
        for repeat in range(opts.repeats + 1):
            names = list(RANK_ROWS) if repeat % 2 else list(reversed(RANK_ROWS))
            for name in names:
                dist.barrier()
                with _without_agreement(name == UNAGREED):
                    watch = trainer_run(work, steps, opts.out, RANK_ROWS[name])
                if repeat:
                    results.setdefault(f"{key}|{name}", []).append([steps / watch.loop, 1e6 * watch.loop_cpu / steps])
    if dist.get_rank() == 0:
        Path(opts.out, "guard_ranks.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def _without_agreement(enabled: bool):
    """For comparison only (unsafe: a bad step on one rank would split the replicas): the
    guard with its per-step all-reduce of the flags left out, to show that all-reduce's share."""
    from workbench.guard import checks as guard_checks

    agree = guard_checks.all_reduce_flags
    if enabled:
        guard_checks.all_reduce_flags = lambda flags: None
    try:
        yield
    finally:
        guard_checks.all_reduce_flags = agree


def launch_ranks(opts: argparse.Namespace) -> int:
    """Start ``opts.processes`` CPU ranks running this script, then print rank 0's table."""
    from workbench.distributed.launch import launcher_command

    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as out:
        args = [__file__, "--repeats", str(opts.repeats), "--workload", opts.workload, "--out", out]
        command, env = launcher_command(opts.processes, args + (["--steps", str(opts.steps)] if opts.steps else []))
        env["PYTHONPATH"] = os.pathsep.join([str(repo), str(repo / "benchmarks")])
        env["OMP_NUM_THREADS"] = "1"
        env["ACCELERATE_USE_CPU"] = "1"  # the gloo case: the one where an all-reduce blocks the host
        result = subprocess.run(command, env=env)
        if result.returncode:
            return result.returncode
        results = json.loads(Path(out, "guard_ranks.json").read_text())
    for key in _workload_keys(opts):
        rows = {name: results[f"{key}|{name}"] for name in RANK_ROWS}
        rates = {name: [r[0] for r in runs] for name, runs in rows.items()}
        cpu = {name: f"{statistics.median(r[1] for r in runs):.0f}" for name, runs in rows.items()}
        print_table(f"{MAKERS[key]().title}: {opts.processes} CPU ranks (gloo), {opts.repeats} repeats, "
                    "alternating (median)", rates, "guard off", {"cpu µs/step": cpu})
        print()
    return 0


def _workload_keys(opts: argparse.Namespace) -> tuple[str, ...]:
    return ("mlp", "lm") if opts.workload == "all" else (opts.workload,)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workload", choices=("mlp", "lm", "all"), default="all")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # set for the ranks
    opts = parser.parse_args()
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:
        rank_main(opts)
        return 0
    if opts.processes > 1:
        return launch_ranks(opts)
    makers = MAKERS
    for key in _workload_keys(opts):
        work = makers[key]()
        steps = opts.steps or work.steps
        with tempfile.TemporaryDirectory() as out:
            rows = {name: partial(trainer_run, guard=guard) for name, guard in ROWS.items()}
            rows[DEVICE_ROW] = partial(trainer_run, guard=GUARD_ON, on_host=False)
            for runner in rows.values():  # warm-up: imports, allocator, first calls
                runner(work, max(steps // 10, 5), out)
            results = round_robin({name: partial(r, work, steps, out) for name, r in rows.items()}, opts.repeats)
        rates = {name: [steps / w.loop for w in watches] for name, watches in results.items()}
        cpu = {name: f"{1e6 * sum(w.loop_cpu for w in ws) / (steps * len(ws)):.0f}" for name, ws in results.items()}
        print_table(f"{work.title}: {steps} steps x {opts.repeats} repeats, round robin (median)", rates,
                    "guard off", {"cpu µs/step": cpu})
        print()
        with tempfile.TemporaryDirectory() as out:
            print_blocked(f"{work.title}: blocked per rollback snapshot vs checkpoint save, {opts.repeats} repeats",
                          blocked_ms(work, out, opts.repeats))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
