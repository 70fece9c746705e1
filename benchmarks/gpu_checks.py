"""Check every CUDA path of workbench in one short run, on a lent GPU machine (or the CPU).

No GPU runs workbench's tests (CI has none), so the paths that only a GPU takes are checked
here, each as one line PASS / FAIL / SKIP with its figures:

1. ``precision``: bf16 and fp16 training (fp16 with Accelerate's GradScaler) of the tiny
   GPT: finite losses that go down, steps/s against fp32 side by side;
2. ``memory``: ``skip_memory_metrics=False`` metrics and the Session's memory reading show
   plausible GPU figures;
3. ``guard``: the guard's device path (fused AdamW ``found_inf`` and SGD masking) skips a
   NaN step and a spike step, as the host path does on the CPU with the same data;
   ``sync``: no host sync on steps that do not log (``torch.cuda.set_sync_debug_mode``
   between their step begin and step end) with no guard, with the guard, in a Session with
   a poller thread, in bf16; fp16 is reported for information (its loss scaler's own reads);
4. ``checkpoint``: a ``save_async`` checkpoint resumes bitwise equal; the time the loop is
   blocked by a rollback snapshot, a synchronous save and an async save of a ~100M-parameter
   model, and the same host copy into reused pinned buffers (measured only, to decide
   whether pinned staging is worth building);
5. ``ranks``: with 2 GPUs, 2 NCCL ranks where only rank 1's loss is NaN skip the same step
   (one GPU: SKIP, NCCL cannot run two ranks on one device);
6. ``env``: versions, device, CUDA.

Each check runs in its own process with its own time limit (killed with its children when
over it, reported FAIL), so one hung or crashed check cannot stop the others, and global
state (sync debug mode, patched tensor methods, the guard's path switch) does not leak.
A total budget (``--budget``) bounds the whole run; a check that no longer fits is SKIP.
The runs are sized to end within the 240 s default budget on one H200 (an estimate: no
GPU has run this script yet); on a loaded 2-core CPU ``--device cpu`` takes about 2 minutes.

On the lent machine (it gets a copy of the working tree; its python3 has torch and
accelerate, maybe not our other dependencies): ``bash benchmarks/gpu_checks.sh``, which
installs workbench without dependencies and runs ``python benchmarks/gpu_checks.py
--device cuda --out "$OUT"``. By hand: ``pip install -e . --no-deps`` with the torch build
the machine has, then ``python benchmarks/gpu_checks.py --device cuda``.

On a CPU-only machine ``--device cpu`` runs what applies there (fp32 and bf16 autocast,
CPU memory fields, the guard's device path forced on the CPU with the CPU proxy counter of
host reads, checkpoints without pinned memory, 2 gloo ranks) and names the parts it SKIPs
(fp16, pinned staging) in its lines, so ``tests/distributed/test_gpu_checks.py`` runs this script and
it cannot rot.

Output: one line per check, then a summary line; exit code 1 if any check FAILed. With
``--out DIR``: gpu_checks.json (every figure) and gpu_checks.log (each check's output).

Usage: python benchmarks/gpu_checks.py [--device cuda|cpu] [--only a,b] [--budget S]
                                      [--check-timeout S] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> time limit in seconds (cuda, cpu), in the order they run; the cpu limits allow for
# a loaded 2-core machine.
CHECKS: dict[str, tuple[float, float]] = {
    "env": (60, 60),
    "precision": (150, 180),
    "memory": (90, 120),
    "guard": (90, 120),
    "sync": (150, 240),
    "checkpoint": (150, 180),
    "ranks": (120, 180),
}
DEFAULT_BUDGET = {"cuda": 240.0, "cpu": 900.0}


@dataclass
class Result:
    """One check's verdict: PASS, FAIL or SKIP, a one-line summary and its figures."""

    name: str
    status: str
    summary: str
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0


def child_env(name: str, device: str) -> dict[str, str]:
    """The environment of check ``name``'s process: ``--device cpu`` hides the GPUs, so every
    part of the stack (Accelerate, the launcher, the ranks) takes its CPU path."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # This tree's workbench first, whatever is installed (the checks are of this copy).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH")) if p)
    if name == "checkpoint":
        # Deterministic cuBLAS for the bitwise resume comparison (read when cuBLAS starts);
        # only there, as it narrows the GEMMs the precision timings may use.
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_check(name: str, device: str, limit: float, log: list[str]) -> Result:
    """Run check ``name`` in a process of its own, killed (with its children) after ``limit`` s."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as tmp:
        result_file = Path(tmp) / "result.json"
        command = [sys.executable, str(HERE / "_gpu_check_bodies.py"), name, device, str(result_file), str(limit)]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=child_env(name, device), cwd=tmp, start_new_session=True)
        timed_out = False
        try:
            output, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the check and whatever it started
            output, _ = proc.communicate()
        seconds = time.perf_counter() - start
        log.append(f"===== {name} (exit {proc.returncode}, {seconds:.1f} s) =====\n{output}")
        if timed_out:
            return Result(name, "FAIL", f"timed out after {limit:g} s; last output: {_last_line(output)}",
                          seconds=seconds)
        if not result_file.is_file():
            return Result(name, "FAIL", f"exited {proc.returncode} without a result; last output: "
                                        f"{_last_line(output)}", seconds=seconds)
        data = json.loads(result_file.read_text())
        return Result(name, data["status"], data["summary"], data.get("figures", {}), seconds)


def _last_line(output: str) -> str:
    lines = [line.strip() for line in (output or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(none)"


def print_line(result: Result) -> None:
    print(f"{result.status:<4} {result.name:<10} {result.seconds:5.1f}s  {result.summary}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--only", default="", help=f"comma-separated checks (default all: {', '.join(CHECKS)})")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run (default 240 on cuda, 900 on cpu)")
    parser.add_argument("--check-timeout", type=float, default=None, help="one time limit for every check")
    parser.add_argument("--out", default=None, help="folder for gpu_checks.json and gpu_checks.log")
    ns = parser.parse_args(argv)
    names = [n.strip() for n in ns.only.split(",") if n.strip()] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"--only: unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    budget = ns.budget if ns.budget is not None else DEFAULT_BUDGET[ns.device]
    start = time.perf_counter()
    results: list[Result] = []
    log: list[str] = []
    no_device: str | None = None
    for name in names:
        left = budget - (time.perf_counter() - start)
        limit = min(ns.check_timeout or CHECKS[name][ns.device == "cpu"], left)
        if no_device is not None and name != "env":
            result = Result(name, "SKIP", no_device)
        elif left < 5:
            result = Result(name, "SKIP", f"the time budget ({budget:.0f} s) is spent")
        else:
            result = run_check(name, ns.device, limit, log)
        if name == "env" and result.status == "FAIL" and ns.device == "cuda":
            no_device = "no usable CUDA device (see env)"
        results.append(result)
        print_line(result)
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    total = time.perf_counter() - start
    print(f"SUMMARY --device {ns.device}: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP "
          f"in {total:.0f} s" + (f" (details in {ns.out})" if ns.out else ""), flush=True)
    if ns.out:
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {"device": ns.device, "seconds": round(total, 1), "results": [asdict(r) for r in results]}
        (out / "gpu_checks.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "gpu_checks.log").write_text("\n".join(log))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
