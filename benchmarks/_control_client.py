"""The client side of the control benchmarks, run as a process of its own (as a real attached
dashboard, notebook or script is), so its JSON decoding never competes for the run's GIL.

Modes (each prints one JSON line of results on stdout, ``watch`` one line per event):

* ``poll OUTDIR --hz 10``: what the attached dashboard calls per refresh (``snapshot()``,
  ``stop_reason``, ``events_since(cursor)``, see widgets/tui/app.py ``poll`` and bridge.py),
  ``--hz`` times a second until the run ends;
* ``watch OUTDIR``: subscribe to the run's events and print ``{"kind", "t", "step"}`` as
  each arrives (``t``: CLOCK_MONOTONIC, the same clock in every process of the machine);
* ``act OUTDIR --samples N``: send ``set(lr_scale=1.0)`` and ``pause()``/``resume()`` N times
  and print when each was sent;
* ``series OUTDIR --samples N``: time ``series(points=2000)`` round trips.

Usage: python benchmarks/_control_client.py MODE OUTDIR [--hz H] [--samples N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from workbench.control.client import RemoteSession, attach
from workbench.control.discovery import NoLiveRun
from workbench.session.state import ENDED


def now() -> float:
    """Seconds on the machine-wide monotonic clock (comparable between processes)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def wait_attach(outdir: str, timeout: float = 120.0) -> RemoteSession:
    """Attach once the run's control.json is there and answers (the run may still be starting)."""
    deadline = now() + timeout
    while True:
        try:
            return attach(outdir)
        except (NoLiveRun, OSError, ValueError):
            if now() > deadline:
                raise
            time.sleep(0.02)


def emit(data: dict) -> None:
    print(json.dumps(data), flush=True)


def poll(outdir: str, hz: float) -> None:
    emit({"ready": True})  # imported: the run may start (the client's start-up is not timed)
    remote = wait_attach(outdir)
    cursor, polls, period = 0, 0, 1.0 / hz
    cpu = time.process_time()
    while True:
        began = now()
        snap = remote.snapshot()
        remote.stop_reason  # noqa: B018 - the dashboard reads it on every refresh
        _, cursor = remote.events_since(cursor)
        polls += 1
        if snap.status in ENDED:
            break
        time.sleep(max(period - (now() - began), 0.0))
    emit({"polls": polls, "client_cpu_s": time.process_time() - cpu})
    remote.close()


def watch(outdir: str) -> None:
    remote = wait_attach(outdir)
    _, cursor = remote.events_since(0)
    emit({"ready": True})
    for event in remote.events(cursor=cursor):
        emit({"kind": event.kind, "t": now(), "step": event.step})


def act(outdir: str, samples: int) -> None:
    remote = wait_attach(outdir)
    sent = []
    for _ in range(samples):
        t0 = now()
        remote.set(lr_scale=1.0).result(timeout=30)
        sent.append({"kind": "edited", "t": t0})
        time.sleep(0.15)
        t0 = now()
        remote.pause()
        sent.append({"kind": "paused", "t": t0})
        time.sleep(0.25)
        remote.resume()
        time.sleep(0.15)
    emit({"sent": sent})
    remote.close()


def series(outdir: str, samples: int) -> None:
    remote = wait_attach(outdir)
    times, sizes = [], set()
    for _ in range(samples):
        t0 = now()
        data = remote.series(points=2000)
        times.append((now() - t0) * 1e3)
        sizes.add(max((len(v) for v in data.values()), default=0))
        time.sleep(0.05)
    times.sort()
    emit({"median_ms": statistics.median(times), "p95_ms": times[int(0.95 * (len(times) - 1))],
          "max_ms": times[-1], "points": sorted(sizes), "names": sorted(data)})
    remote.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["poll", "watch", "act", "series"])
    parser.add_argument("outdir")
    parser.add_argument("--hz", type=float, default=10.0)
    parser.add_argument("--samples", type=int, default=20)
    ns = parser.parse_args()
    if ns.mode == "poll":
        poll(ns.outdir, ns.hz)
    elif ns.mode == "watch":
        watch(ns.outdir)
    elif ns.mode == "act":
        act(ns.outdir, ns.samples)
    else:
        series(ns.outdir, ns.samples)


if __name__ == "__main__":
    main()
