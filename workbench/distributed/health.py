"""Run health: hangs and stragglers found in seconds, on one process as on several.

Every rank runs a small watchdog thread (:class:`HealthMonitor`, once a second). It reads
the rank's own time ledger (core/ledger.py: the phase the training thread is in and since
when) and, with several processes, publishes a heartbeat -- step, phase, seconds in it, own
work per step -- to the job's rendezvous store, the key-value store every rank already
talks to. Rank 0's watchdog reads all of them. Nothing of this touches the training thread
or a collective: a heartbeat tied to the ranks' agreement (rank_sync.py) would stop with the
very rank that hangs, and could not say where it is; the store goes on answering while a
rank's training thread is stuck in its data loader or a collective.

* **Hang**: a rank that has stood in one phase for ``hang_timeout`` seconds -- any phase but
  start-up and a pause (core/ledger.py HANG_PHASES: a step's, evaluation, save, "other" such
  as a callback) -- or whose heartbeat has stopped. An evaluation marks each batch done, so a
  long one that makes progress is no hang; a save or a callback has no such mark, so
  ``hang_timeout`` must exceed the longest of them. Rank 0 names the rank the others wait
  for (:func:`culprit`), writes a ``hang`` record, and every rank dumps all its threads'
  stacks (faulthandler: no ptrace) into ``output_dir/hang-<time>/rank-<n>.txt``. With
  ``hang_action = "stop"`` every rank then exits with code 3 so a scheduler restarts the
  job, which resumes from the last checkpoint. With "report", once the rank moves again (a
  later step or phase) a ``hang_cleared`` record says so and the hang leaves the snapshot;
  a later hang is reported and dumped again, into a folder of its own.
* **Straggler**: a rank whose own work per step (data, forward and optimizer: not the
  backward, where DDP's ranks wait for each other) stays above ``straggler_factor`` x the
  median of the other ranks' for ``straggler_after`` seconds. Each rank's work per step and
  its factor over the others' median are published live (``latest["ranks"]``).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.core.args.training import ArgumentError
from workbench.core.exit_codes import EXIT_HUNG
from workbench.core.ledger import HANG_PHASES, Ledger
from workbench.distributed.oom_flags import rendezvous_store

log = logging.getLogger("workbench")

__all__ = ["HEALTH_FIELDS", "Health", "HealthMonitor", "culprit"]

_KEY = "workbench/health/{}"
_HANG_KEY = "workbench/health/hang"


@dataclass(frozen=True)
class Health:
    """How a run watches itself (the ``[health]`` table; ``Trainer(health=...)``).

    ``hang_timeout``: seconds a rank may stand in one phase before it is a hang (0: never;
    above the longest save or callback, which show no progress while they run);
    ``hang_action``: "report" (say so, dump stacks, keep waiting) or "stop" (then exit 3);
    ``straggler_factor`` / ``straggler_after``: how much slower than the other ranks' median,
    for how many seconds, before a rank is named a straggler; ``peak_tflops``: the device's
    peak dense TFLOP/s for MFU where the built-in table does not know it (per device);
    ``oom_retries``: times an out-of-memory step is retried with half the micro-batch.
    """

    hang_timeout: float = 120.0
    hang_action: str = "report"
    straggler_factor: float = 2.0
    straggler_after: float = 20.0
    peak_tflops: float | None = None
    oom_retries: int = 3

    def __post_init__(self) -> None:
        def number(name: str, low: float, strict: bool = False) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < low or (strict and value == low):
                raise ArgumentError(name, f"expected a number {'>' if strict else '>='} {low:g}, got {value!r}")

        number("hang_timeout", 0)
        if self.hang_action not in ("report", "stop"):
            raise ArgumentError("hang_action", f'expected "report" or "stop", got {self.hang_action!r}')
        number("straggler_factor", 1, strict=True)
        number("straggler_after", 0)
        if self.peak_tflops is not None:
            number("peak_tflops", 0, strict=True)
        if isinstance(self.oom_retries, bool) or not isinstance(self.oom_retries, int) or self.oom_retries < 0:
            raise ArgumentError("oom_retries", f"expected a whole number >= 0, got {self.oom_retries!r}")


HEALTH_FIELDS = tuple(f.name for f in dataclasses.fields(Health))


# A rank in a collective waits for the others: the rank they wait for is elsewhere.
_WAITING = ("collective",)
# Where a phase comes in a step, for ranks at the same step: the ledger's step moves at the
# optimizer's end, so the step end's callbacks ("other"), evaluation and save come first (0),
# then the next step's data, forward, backward and optimizer. The earliest is furthest behind.
_STAGE = {"data": 1, "forward": 2, "backward": 3, "optimizer": 4}
_DONE = "done"  # the phase of a rank's last heartbeat, once its train() has ended


def culprit(beats: dict[int, dict[str, Any]], now: float, timeout: float) -> tuple[int, dict[str, Any]] | None:
    """The rank a hang is blamed on: a rank whose heartbeat stopped; else, of the ranks not
    waiting in a collective (all of them if every one is), the furthest behind -- lowest step,
    then earliest part of a step, then longest in its phase -- once it has stood in one phase
    of HANG_PHASES for ``timeout`` seconds (a rank that left train() when all the others
    wait); None while there is no such rank."""
    silent = [(r, b) for r, b in beats.items() if b["phase"] != _DONE and now - b["time"] > max(timeout, 5.0)]
    if silent:
        return min(silent, key=lambda rb: rb[1]["time"])
    watched = {r: b for r, b in beats.items() if b["phase"] in HANG_PHASES}
    pool = {r: b for r, b in watched.items() if b["phase"] not in _WAITING} or watched
    if not pool:
        return None
    rank, beat = min(pool.items(), key=lambda rb: (rb[1]["step"], _STAGE.get(rb[1]["phase"], 0), -rb[1]["in_phase"], rb[0]))
    # Blamed only once it stands still itself: a rank moving through long phases is slow, not stuck.
    if beat["in_phase"] <= timeout:
        return None
    left = [(r, b) for r, b in beats.items() if b["phase"] == _DONE]
    if beat["phase"] in _WAITING and left:  # every rank still training waits: for one whose train() ended (an error)
        return min(left, key=lambda rb: rb[1]["time"])
    return rank, beat


class HealthMonitor:
    """One rank's watchdog thread (module docstring). ``report(kind, record)`` hears hangs,
    their end (``hang_cleared``) and stragglers on rank 0 (events.jsonl, the Session);
    ``latest`` holds the hang under way, the stragglers named and each rank's step figures."""

    def __init__(self, ledger: Ledger, settings: Health, output_dir: str, *, rank: int = 0, world: int = 1,
                 store: Any = None, report: Callable[[str, dict[str, Any]], None] | None = None,
                 interval: float = 1.0, exit_process: Callable[[int], None] = os._exit) -> None:
        self.ledger, self.settings, self.output_dir = ledger, settings, Path(output_dir)
        self.rank, self.world, self.store = rank, world, store
        self.report = report or (lambda kind, record: None)
        self.interval = interval
        self._exit = exit_process
        self.latest: dict[str, dict[str, Any]] = {}
        self.beats: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dumped: str | None = None  # the folder of the hang this rank last dumped its stacks for
        self._stalled = (None, 0.0)  # rank 0: the hung rank's phase entry (its ledger's since), when it stalled
        self._work = 0.0  # own work per step, smoothed
        self._last = (ledger.step, self._own_work())
        self._slow_since: dict[int, float] = {}

    # -- life --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the watchdog (a daemon thread: it never keeps a process alive)."""
        if self._thread is None and (self.settings.hang_timeout or self.world > 1):
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="workbench-health", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the watchdog (the run has ended or is paused for good), then take a last look."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        try:
            self._last_look()
        except Exception as exc:  # noqa: BLE001 - the store may be gone with the other ranks
            log.debug("health watchdog, last look: %s", exc)

    def _last_look(self) -> None:
        """A last heartbeat saying this rank's train() is over (rank 0 never takes its silence
        for a hang). On rank 0 a hang whose rank moved since the last look leaves the snapshot
        without a record -- the run's ``end`` record, written already, closes it -- and one
        still standing is marked over in the store (a later train() must not dump for it)."""
        beat = self.beat()
        if self.store is not None:
            self.store.set(_KEY.format(self.rank), json.dumps({**beat, "phase": _DONE}))
        if self.rank == 0 and "hang" in self.latest:
            self.beats = self._read_beats(beat)
            self._settle(time.time(), report=False)
            if "hang" in self.latest and self.store is not None:
                self.store.set(_HANG_KEY, json.dumps({**self.latest["hang"], "cleared": True}))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - a watchdog must never end the run
                log.debug("health watchdog: %s", exc)

    # -- one look ------------------------------------------------------------------------------

    def _own_work(self) -> float:
        seconds = self.ledger.seconds
        return seconds["data"] + seconds["forward"] + seconds["optimizer"]

    def beat(self) -> dict[str, Any]:
        """This rank's heartbeat: where its training thread is, and its own work per step."""
        step, work = self.ledger.step, self._own_work()
        last_step, last_work = self._last
        if step > last_step:
            per_step = (work - last_work) / (step - last_step)
            self._work = per_step if not self._work else 0.7 * self._work + 0.3 * per_step
            self._last = (step, work)
        # "since" (when the phase began, this process's clock) tells one stay in a phase from the next.
        # The ledger rides along (a dozen numbers a beat, off the training thread): rank 0 then
        # knows where every rank's time went, not only its own.
        return {"rank": self.rank, "step": step, "phase": self.ledger.phase, "in_phase": self.ledger.in_phase_for(),
                "since": self.ledger.since, "work": self._work, "time": time.time(), "pid": os.getpid(),
                "ledger": self.ledger.summary()}

    def tick(self) -> None:
        """Publish this rank's heartbeat; on rank 0 read everyone's and judge; dump stacks
        when a hang was declared (by rank 0, or by this rank alone with one process)."""
        beat = self.beat()
        if self.store is not None:
            self.store.set(_KEY.format(self.rank), json.dumps(beat))
        if self.rank == 0:
            self.beats = self._read_beats(beat)
            self._judge(time.time())
        elif self.store is not None and self.store.check([_HANG_KEY]):
            record = json.loads(self.store.get(_HANG_KEY))
            if not record.get("cleared") and record["folder"] != self._dumped:  # a hang this rank has not dumped for
                self._on_hang(record)

    def _read_beats(self, own: dict[str, Any]) -> dict[int, dict[str, Any]]:
        beats = {0: own}
        for rank in range(1, self.world):
            key = _KEY.format(rank)
            if self.store is not None and self.store.check([key]):
                beats[rank] = json.loads(self.store.get(key))
            elif rank in self.beats:
                beats[rank] = self.beats[rank]  # the last one seen: its age tells the silence
        return beats

    def _judge(self, now: float) -> None:
        if self.settings.hang_timeout:
            if "hang" in self.latest:
                self._settle(now)
            if "hang" not in self.latest:
                found = culprit(self.beats, now, self.settings.hang_timeout)
                if found is not None:
                    self._declare(*found, now)
        if self.world > 1:
            self._judge_stragglers(now)
            self.latest["ranks"] = self._rank_figures()

    def _declare(self, rank: int, beat: dict[str, Any], now: float) -> None:
        """A hang: the record (latest, the store for the other ranks, the report), then the stacks."""
        silent = now - beat["time"] > max(self.settings.hang_timeout, 5.0)
        seconds = now - beat["time"] if silent else beat["in_phase"]
        record = {"rank": rank, "phase": beat["phase"], "stalled_step": beat["step"], "seconds": round(seconds, 1),
                  "silent": silent, "action": self.settings.hang_action, "folder": self._new_folder(),
                  "ranks": {str(r): {"step": b["step"], "phase": b["phase"]} for r, b in self.beats.items()}}
        self._stalled = (beat.get("since"), now - seconds)
        self.latest["hang"] = record
        if self.store is not None:
            self.store.set(_HANG_KEY, json.dumps(record))
        self.report("hang", record)
        self._on_hang(record)

    def _settle(self, now: float, report: bool = True) -> None:
        """The hang under way: cleared once its rank has moved (another step or phase, its
        heartbeat back), with a ``hang_cleared`` record; until then its seconds kept current."""
        hang = self.latest["hang"]
        beat = self.beats.get(hang["rank"])
        if beat is None:
            return
        since, stalled_at = self._stalled
        heard = beat["phase"] == _DONE or now - beat["time"] <= max(self.settings.hang_timeout, 5.0)
        moved = (beat["step"], beat["phase"], beat.get("since")) != (hang["stalled_step"], hang["phase"], since)
        if not (heard and moved):
            seconds = beat["in_phase"] if heard else now - stalled_at  # the time in the phase it stands in
            self.latest["hang"] = {**hang, "seconds": round(seconds, 1)}
            return
        del self.latest["hang"]
        if self.store is not None:  # the other ranks dump again only for a hang declared after this
            self.store.set(_HANG_KEY, json.dumps({**hang, "cleared": True}))
        if report:
            self.report("hang_cleared", {"rank": hang["rank"], "phase": hang["phase"], "stalled_step": hang["stalled_step"],
                                         "at_step": beat["step"], "phase_now": beat["phase"],
                                         "seconds": round(now - stalled_at, 1), "folder": hang["folder"]})

    def _new_folder(self) -> str:
        """``output_dir/hang-<time>``, numbered when a hang of the same second has it already."""
        base = self.output_dir / f"hang-{time.strftime('%Y%m%d-%H%M%S')}"
        folder, n = base, 1
        while folder.exists() or str(folder) == self._dumped:
            n += 1
            folder = base.with_name(f"{base.name}-{n}")
        return str(folder)

    def _rank_figures(self) -> dict[str, dict[str, Any]]:
        """Each rank's step, phase, own work per step (seconds), its factor over the median
        of the other ranks' (None until both are known) and its time ledger as of its last
        beat: the live straggler view, and where each rank's time went."""
        works = {r: b.get("work") or 0.0 for r, b in self.beats.items()}
        figures = {}
        for rank, beat in sorted(self.beats.items()):
            others = [w for r, w in works.items() if r != rank and w]
            median = statistics.median(others) if others else 0.0
            work = works[rank]
            figures[str(rank)] = {"step": beat["step"], "phase": beat["phase"], "work_per_step": round(work, 4),
                                  "factor": round(work / median, 2) if work and median else None,
                                  "ledger": beat.get("ledger")}
        return figures

    def _judge_stragglers(self, now: float) -> None:
        works = {r: b["work"] for r, b in self.beats.items() if b.get("work")}
        if len(works) < 2:
            return
        named = {r.get("rank") for r in self.latest.get("stragglers", {}).get("ranks", [])}
        for rank, work in works.items():
            others = statistics.median(w for r, w in works.items() if r != rank)
            if others and work > self.settings.straggler_factor * others:
                since = self._slow_since.setdefault(rank, now)
                if now - since >= self.settings.straggler_after and rank not in named:
                    record = {"rank": rank, "work_per_step": round(work, 4), "others_median": round(others, 4),
                              "factor": round(work / others, 2), "for_seconds": round(now - since, 1),
                              "at_step": self.beats[rank]["step"]}
                    entry = self.latest.setdefault("stragglers", {"ranks": []})
                    entry["ranks"].append(record)
                    self.report("straggler", record)
            else:
                self._slow_since.pop(rank, None)

    # -- a hang ----------------------------------------------------------------------------

    def _on_hang(self, record: dict[str, Any]) -> None:
        """Dump this rank's stacks into the hang's folder; with ``hang_action = "stop"``, exit 3."""
        if self._dumped != record["folder"]:
            folder = Path(record["folder"])
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"rank-{self.rank}.txt"
            with open(path, "w", encoding="utf-8") as f:
                f.write(f"rank {self.rank} (pid {os.getpid()}): step {self.ledger.step}, phase {self.ledger.phase} "
                        f"for {self.ledger.in_phase_for():.1f} s\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            self._dumped = record["folder"]
        if record.get("action") == "stop":
            from workbench.distributed.launch import report_exit_code

            # Under `workbench run --num-processes` rank 0 tells the parent the code first; the
            # others leave after it (a rank leaving first would have the launcher tear rank 0
            # down before it said why). The training thread is stuck, so the process ends
            # here, without its usual teardown.
            code = report_exit_code(EXIT_HUNG, is_main=self.rank == 0)
            if self.rank == 0:
                if self.world > 1:
                    self._wait_for_dumps(Path(record["folder"]))
                print(f"workbench: hang: stopping with exit code {EXIT_HUNG} (stacks in {record['folder']}); "
                      "resume with --resume", file=sys.stderr, flush=True)
            else:
                time.sleep(30)  # the launcher ends this rank once rank 0 has gone
            self._exit(code)

    def _wait_for_dumps(self, folder: Path, timeout: float = 10.0) -> None:
        """Rank 0 leaves last: the others dump once they read the hang from the store."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(list(folder.glob("rank-*.txt"))) < self.world:
            time.sleep(0.1)


def monitor_for(run: Any) -> HealthMonitor:
    """The watchdog of ``run``'s rank: the rendezvous store with several processes, and a
    report that (on rank 0) appends the record to events.jsonl, prints one line on stderr and
    tells ``run.health_listeners`` (a Session publishes it to its front-ends)."""
    from workbench.core.event_file import EventFile

    acc = run.accelerator
    # No store (another launcher's group): each rank watches itself.
    store = rendezvous_store() if acc.num_processes > 1 else None
    events = EventFile(run.args.output_dir)

    def report(kind: str, record: dict[str, Any]) -> None:
        events.write(kind, run.state.global_step, **record)
        if kind == "hang":
            where = "stopped sending heartbeats" if record["silent"] else f"has been in {record['phase']}"
            print(f"workbench: hang: rank {record['rank']} {where} at step {record['stalled_step']} for "
                  f"{record['seconds']:.0f} s; stacks of every rank in {record['folder']}", file=sys.stderr, flush=True)
        elif kind == "hang_cleared":
            where = "its training over" if record["phase_now"] == _DONE else f"now in {record['phase_now']}"
            print(f"workbench: hang over: rank {record['rank']} moved on after {record['seconds']:.0f} s "
                  f"({where} at step {record['at_step']})", file=sys.stderr, flush=True)
        else:
            print(f"workbench: straggler: rank {record['rank']} takes {record['factor']}x the other ranks' time "
                  f"for its own work per step (for {record['for_seconds']:.0f} s)", file=sys.stderr, flush=True)
        for listener in list(getattr(run, "health_listeners", ())):
            listener(kind, record)

    return HealthMonitor(run.ledger, run.health, run.args.output_dir, rank=acc.process_index,
                         world=acc.num_processes, store=store, report=report)
