"""Client load: a run's steps/s with 0, 1, 20 and 100 aggressive clients on its control endpoint.

Each aggressive client (benchmarks/_control_client.py ``hammer``) loops ``snapshot`` (every
field and the whole curves, no ``since``), ``series(points=2000)`` and ``events`` from cursor
0 as fast as replies come, on a connection of its own: the worst a client holding the run's
socket (or token) can ask for, with nothing of its own to slow it down (it reads each reply
line without decoding it). The clients are threads of client processes (at most 25 a
process), all connected before timing starts; the run is one Session in this process (a
small MLP, series prefilled to their 2,000-point bound, a log every ``--logging-steps``, so
the curves change while the clients read them).

Side by side in one run: the run trains throughout while the number of clients hammering
rotates through the rows (0, 1, 20, 100; the others stay connected and idle), ``--phase``
seconds each, ``--cycles`` times, the first ``--settle`` seconds of each phase untimed. A
shared machine's load drifts over minutes; a phase lasts seconds, so every row sees the
same machine. Per row, medians over the cycles of: steps/s and its ratio to 0 clients in
the same cycle, the run process's CPU per step, and what the endpoint did (the CPU its
thread used, requests answered and delayed), plus the client processes' CPU.

Target: 100 aggressive clients cost the run under 10% of its steps/s (ratio >= 0.90); the
endpoint's thread stays within its budget (workbench/control/reactor.py SERVER_SHARE, 3% of
a core) whatever the number of clients.

Results (a 2-core CPU VM shared with other builds and tests: load average 5-9, so single
phases swing +-40%; the medians over 10 cycles of 2.5 s are the figures). Ratio of steps/s to
0 clients in the same cycle, and of the training thread's loop time (its GIL waits included):

  before (a thread per connection; each poll re-encoded the curves, ~40 ms of json.dumps
  holding the GIL; at most 32 connections):
      1 client 0.495 (loop 0.391), 20 clients 0.042 (loop 0.020): 85 -> 3.5 steps/s;
      100 clients could not connect (68 refused, reconnecting)
  after (one reactor thread, CPU budgets, replies encoded once), two invocations:
      1 client  1.020 / 0.958 (loop 1.006 / 0.993), endpoint CPU 1.7% of a core
      20 clients 1.034 / 0.914 (loop 1.006 / 0.953), endpoint CPU 2.8%
      100 clients 0.989 / 0.983 (loop 0.959 / 0.989), endpoint CPU 2.7-2.9%
  so the target holds: 100 clients cost 1-2% (within this machine's noise), the endpoint
  stays at its 3% budget, and the worst-case client is answered ~5 times a second alone,
  every ~2-3 s among 100 (a dashboard's delta polls cost a tenth of these requests).
Usage: python benchmarks/client_load.py [--clients 0,1,20,100] [--cycles N] [--phase S] [--settle S]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from control_overhead import make_session

from workbench.data.builtin import load_builtin_data

CLIENT = str(Path(__file__).with_name("_control_client.py"))
PER_PROCESS = 25  # client threads per client process


def start_clients(out: str, count: int) -> list[tuple[subprocess.Popen, int]]:
    """Client processes holding ``count`` threads in all (imported; connecting once the run serves)."""
    procs = []
    left = count
    while left > 0:
        threads = min(left, PER_PROCESS)
        left -= threads
        procs.append((subprocess.Popen([sys.executable, CLIENT, "hammer", out, "--threads", str(threads)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True), threads))
    for proc, _ in procs:
        assert json.loads(proc.stdout.readline()) == {"ready": True}
    return procs


def set_active(procs: list[tuple[subprocess.Popen, int]], active: int) -> None:
    """Make ``active`` clients hammer (filling the processes in order), the rest idle."""
    left = active
    for proc, threads in procs:
        proc.stdin.write(f"{min(left, threads)}\n")
        proc.stdin.flush()
        left -= min(left, threads)
    for proc, _ in procs:
        json.loads(proc.stdout.readline())  # {"hammering": n}: they have all had a round answered


def schedstat(tid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting for one) of thread ``tid`` so far (Linux schedstat)."""
    run, wait, _ = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
    return int(run) / 1e9, int(wait) / 1e9


def measure(session, seconds: float) -> dict:
    """Steps, CPU and the endpoint's counters over ``seconds`` of the run.

    ``loop_us_step``: the training thread's wall time per step less the time it waited for a
    CPU (the machine's other load): its own work plus the time it waited for the GIL (it
    does no other waiting), so the cost of the endpoint's thread without the noise of a
    shared machine's run queue."""
    trainer, server, tid = session.trainer, session._server, session._thread.native_id
    stats = getattr(server, "stats", dict)
    before, t0, s0, c0, q0 = stats(), time.perf_counter(), trainer.state.global_step, time.process_time(), schedstat(tid)
    time.sleep(seconds)
    after, t1, s1, c1, q1 = stats(), time.perf_counter(), trainer.state.global_step, time.process_time(), schedstat(tid)
    elapsed, steps = t1 - t0, max(s1 - s0, 1)
    row = {"steps_s": steps / elapsed, "cpu_us_step": (c1 - c0) / steps * 1e6,
           "loop_us_step": (elapsed - (q1[1] - q0[1])) / steps * 1e6, "train_cpu_us_step": (q1[0] - q0[0]) / steps * 1e6}
    if before and after:
        row["server_cpu"] = (after["cpu_s"] - before["cpu_s"]) / elapsed
        row["answered_s"] = (after["requests"] - before["requests"]) / elapsed
        row["delayed_s"] = (after["delayed"] - before["delayed"]) / elapsed
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="0,1,20,100")
    parser.add_argument("--cycles", type=int, default=8)
    parser.add_argument("--phase", type=float, default=3.0, help="seconds each row runs per cycle")
    parser.add_argument("--settle", type=float, default=0.5, help="untimed seconds at the start of a phase")
    parser.add_argument("--logging-steps", type=int, default=10)
    ns = parser.parse_args()
    counts = [int(c) for c in ns.clients.split(",")]
    torch.set_num_threads(1)  # overhead-bound on purpose: the model is tiny
    train, _ = load_builtin_data("random-classification", n_train=8192)
    rows: dict[int, list[dict]] = {c: [] for c in counts}
    with tempfile.TemporaryDirectory() as tmp:
        procs = start_clients(tmp, max(counts))
        session = make_session(10**9, 32, train, tmp, ns.logging_steps, prefill=4000)
        session.start()
        try:
            while session.trainer.state.global_step < 100:  # past the first steps' one-time costs
                time.sleep(0.01)
            set_active(procs, max(counts))  # every client connected and answered once before timing
            for cycle in range(ns.cycles):
                order = counts[cycle % len(counts):] + counts[:cycle % len(counts)]
                for count in order:
                    set_active(procs, count)
                    time.sleep(ns.settle)
                    rows[count].append(measure(session, ns.phase - ns.settle))
        finally:
            for proc, _ in procs:
                proc.stdin.close()
            reports = [json.loads(proc.stdout.readline() or "{}") for proc, _ in procs]
            for proc, _ in procs:
                proc.wait(60)
            session.stop(save=False)
            session.wait(60)
            session.close()
    base = counts[0]
    print(f"small MLP, batch 32, logging_steps {ns.logging_steps}, series full; one run, {ns.cycles} cycles of "
          f"{ns.phase:g} s phases ({ns.settle:g} s untimed); medians, ratios to {base} clients in the same cycle")
    print(f"{'clients':>7} {'steps/s':>8} {'ratio':>6} {'[min-max]':>11} {'loop µs/step':>12} {'ratio':>6} "
          f"{'[min-max]':>11} {'train CPU':>9} {'run CPU':>8} {'server CPU':>10} {'answered/s':>10} {'delayed/s':>9}")
    for count in counts:
        got = rows[count]

        def ratio(key: str, inverse: bool = False, got=got) -> list[float]:
            return [(b[key] / r[key]) if inverse else (r[key] / b[key]) for r, b in zip(got, rows[base])]

        def med(key: str, got=got) -> float:
            values = [r[key] for r in got if key in r]
            return statistics.median(values) if values else float("nan")

        steps, loop = ratio("steps_s"), ratio("loop_us_step", inverse=True)  # both as speed ratios
        print(f"{count:>7} {med('steps_s'):>8.1f} {statistics.median(steps):>6.3f} "
              f"{f'[{min(steps):.2f}-{max(steps):.2f}]':>11} {med('loop_us_step'):>12.0f} "
              f"{statistics.median(loop):>6.3f} {f'[{min(loop):.2f}-{max(loop):.2f}]':>11} "
              f"{med('train_cpu_us_step'):>9.0f} {med('cpu_us_step'):>8.0f} {med('server_cpu') * 100:>9.1f}% "
              f"{med('answered_s'):>10.0f} {med('delayed_s'):>9.0f}")
    total = sum(r.get("client_cpu_s", 0.0) for r in reports)
    print(f"client processes: {sum(r.get('replies', 0) for r in reports)} replies, "
          f"{sum(r.get('bytes', 0) for r in reports) / 1e6:.0f} MB read, {total:.1f} s CPU in all, "
          f"{sum(r.get('reconnects', 0) for r in reports)} reconnects")


if __name__ == "__main__":
    main()
