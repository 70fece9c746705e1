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
* ``series OUTDIR --samples N``: time ``series(points=2000)`` round trips;
* ``hammer OUTDIR --threads N``: N aggressive clients (threads, each on its own connection)
  looping ``snapshot`` (every field and the whole curves), ``series(points=2000)`` and
  ``events`` from cursor 0 as fast as replies come, reading each reply line without decoding
  it (the client costs its own machine as little as possible; the run pays for the rest).
  Prints ``{"ready"}`` once imported; each line on stdin sets how many of them hammer (the
  others stay connected, idle); an empty line or EOF ends them.

Usage: python benchmarks/_control_client.py MODE OUTDIR [--hz H] [--samples N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time

from workbench.control.client import RemoteSession, attach
from workbench.control.discovery import NoLiveRun, read_control
from workbench.door.values import ENDED


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


_HAMMER = [json.dumps({"id": i, "cmd": cmd, "args": args}).encode() + b"\n" for i, (cmd, args) in enumerate(
    (("snapshot", {}), ("series", {"points": 2000}), ("events", {"cursor": 0})))]


def _hammer_one(outdir: str, index: int, active: list, stop: threading.Event, tally: dict, lock: threading.Condition,
                answered: list, busy: set) -> None:
    """One aggressive client: hammers while ``index < active[0]``, idles (connected) otherwise,
    and reconnects whenever it is closed or refused, until ``stop``."""
    rounds = replies = size = refused = 0
    first = True
    while not stop.is_set():
        sock = None
        try:
            info = read_control(outdir)
            if info.get("socket"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(info["socket"])
            else:
                host, _, port = str(info["tcp"]).rpartition(":")
                sock = socket.create_connection((host, int(port)))
            sock.settimeout(30)
            reader = sock.makefile("rb")
            sock.sendall(json.dumps({"id": 0, "cmd": "hello", "args": {"token": info.get("token")}}).encode() + b"\n")
            if b'"ok":true' not in reader.readline():
                raise ConnectionError("refused")
            while not stop.is_set():
                with lock:
                    busy.discard(index)
                    lock.notify_all()
                    while index >= active[0] and not stop.is_set():
                        lock.wait()  # idle, connected
                    busy.add(index)
                for line in _HAMMER:
                    sock.sendall(line)
                    reply = reader.readline()
                    if not reply:
                        raise ConnectionError("closed")
                    replies += 1
                    size += len(reply)
                rounds += 1
                if first:
                    first = False
                    with lock:
                        answered[0] += 1
        except (OSError, ValueError, ConnectionError, NoLiveRun):
            refused += not first  # a connection lost after the first round (not the wait for the run to serve)
            time.sleep(0.02)
        finally:
            if sock is not None:
                sock.close()
            with lock:
                busy.discard(index)
                lock.notify_all()
    with lock:
        for key, value in (("rounds", rounds), ("replies", replies), ("bytes", size), ("reconnects", refused)):
            tally[key] = tally.get(key, 0) + value


def hammer(outdir: str, threads: int) -> None:
    """``threads`` clients, all connected; stdin says how many hammer: a line with a number
    (``K``: the first K; prints ``{"hammering": n}`` once n of them had a round answered,
    ``{"phase": replies}`` for the previous phase), an empty line or EOF ends it all."""
    emit({"ready": True})
    stop, lock = threading.Event(), threading.Condition()
    tally: dict = {}
    answered, active, busy = [0], [0], set()
    workers = [threading.Thread(target=_hammer_one, args=(outdir, i, active, stop, tally, lock, answered, busy),
                                daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    cpu = time.process_time()
    while (line := sys.stdin.readline().strip()):
        with lock:
            active[0] = int(line)
            lock.notify_all()
            # Every thread asked to hammer has had a round answered, and the others are idle.
            lock.wait_for(lambda: answered[0] >= active[0] and all(i < active[0] for i in busy), timeout=120)
        emit({"hammering": min(answered[0], active[0])})
    with lock:
        stop.set()
        lock.notify_all()
    for worker in workers:
        worker.join(35)
    emit({**tally, "client_cpu_s": time.process_time() - cpu})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["poll", "watch", "act", "series", "hammer"])
    parser.add_argument("outdir")
    parser.add_argument("--hz", type=float, default=10.0)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    ns = parser.parse_args()
    if ns.mode == "poll":
        poll(ns.outdir, ns.hz)
    elif ns.mode == "watch":
        watch(ns.outdir)
    elif ns.mode == "act":
        act(ns.outdir, ns.samples)
    elif ns.mode == "hammer":
        hammer(ns.outdir, ns.threads)
    else:
        series(ns.outdir, ns.samples)


if __name__ == "__main__":
    main()
