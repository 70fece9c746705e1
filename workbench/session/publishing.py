"""What a Session tells of its run: the immutable snapshot front-ends poll, the events they
follow by cursor, and the hooks that keep both current.

The Session's observer callback (``SessionObserver`` in local.py) hears logs, evaluations and saves as any HF
callback does; the steering gate's step end calls ``_tick`` (at most ten snapshots a second,
memory sampled once a second). A snapshot is built under the Session's lock and swapped in
whole, so a front-end reads it without locking and never sees half of one. A mixin of
:class:`workbench.session.local.Session`.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

from workbench.core.event_file import EventFile
from workbench.door.values import ENDED, SNAPSHOT_EDITS, SNAPSHOT_INTERVENTIONS, Intervention, SessionEvent, Snapshot, Status

__all__ = ["SessionPublishing"]


class SessionPublishing:
    """The published view of a Session (mixed into it)."""

    def snapshot(self) -> Snapshot:
        """The latest immutable view of the run (cheap: no locking, no device access)."""
        return self._snapshot

    def subscribe(self, maxsize: int = 10_000) -> queue.Queue:
        """A queue receiving every SessionEvent from now on (oldest dropped when full)."""
        return self._events.subscribe(maxsize)

    def unsubscribe(self, q: queue.Queue) -> None:
        """Stop delivering events to ``q``."""
        self._events.unsubscribe(q)

    def events_since(self, cursor: int = 0) -> tuple[list[SessionEvent], int]:
        """The events after ``cursor`` and the cursor to pass next time: poll with
        ``events, cursor = session.events_since(cursor)``, starting from 0 (the run's first
        event). Only the newest EVENT_HISTORY events are kept: a reader further behind
        gets those. Plain request and answer, so a front-end in another process can poll
        it too."""
        return self._events.since(cursor)

    def events(self, timeout: float | None = None) -> Iterator[SessionEvent]:
        """Iterate over events as they happen until the run ends (or nothing arrives for ``timeout``)."""
        q = self.subscribe()
        try:
            while True:
                try:
                    event = q.get(timeout=timeout if timeout is not None else 0.25)
                except queue.Empty:
                    if timeout is not None or self._status in ENDED or self._status == Status.IDLE:
                        return
                    continue
                yield event
                if event.kind in ("finished", "failed"):
                    return
        finally:
            self.unsubscribe(q)

    # -- what the run tells (the observer callback), and the published view ------------------------

    def _on_train_begin(self, state) -> None:
        self._started_at = self._pause_clock.now()
        self._start_step = state.global_step
        # A resumed run's edits come with its checkpoint.
        self._edits = [dict(e) for e in self.trainer.workbench_state.live_edits]
        self._refresh_catalog()
        self._emit("started", max_steps=state.max_steps)

    def _refresh_catalog(self) -> None:
        try:
            self._catalog = tuple(self.checkpoints)
        except OSError:  # an unreadable folder keeps the last catalog; the next save retries
            pass

    def _tick(self, state) -> None:
        now = time.perf_counter()
        if now - self._last_tick >= 0.1:  # the live view refreshes at most 10 times a second
            self._last_tick = now
            if now - self._memory_at >= 1.0:  # memory is sampled, not read per step
                self._memory_at = now
                try:
                    self._memory = self.memory()
                except Exception as exc:  # noqa: BLE001 - a report must never end the run
                    if not self._memory_failed:
                        self._memory_failed = True
                        logging.getLogger("workbench").warning("memory report unavailable (%s: %s); the run goes on without it",
                                    type(exc).__name__, exc)
            self._publish()

    def _on_log(self, state, logs: dict[str, Any]) -> None:
        with self._lock:  # snapshot() readers iterate the series under the same lock
            self._series.add_log(state.global_step, logs)
        if "loss" in logs:
            self._emit("logged", **logs)
        self._publish()

    def _on_evaluate(self, state, metrics: dict[str, Any]) -> None:
        with self._lock:
            self._series.add_eval(state.global_step, metrics)
        futures, self._pending_evals = self._pending_evals, []
        for f in futures:
            f.set_result(dict(metrics))
        self._set_status(Status.RUNNING, only_from=(Status.EVALUATING,))
        self._emit("evaluated", **metrics)
        self._publish()

    def _on_sample(self, state, samples: list[dict[str, Any]]) -> None:
        # One "sampled" event per prompt ({prompt, answer, tokens}), as events.jsonl has one
        # "sample" record per prompt: front-ends gather them by prompt.
        for sample in samples:
            self._emit("sampled", **sample)

    def _on_save(self, state) -> None:
        path = Path(self.trainer.args.output_dir) / f"checkpoint-{state.global_step}"
        futures, self._pending_saves = self._pending_saves, []
        self._set_status(Status.RUNNING, only_from=(Status.SAVING,))

        def published(write: Future | None = None) -> None:
            error = write.exception() if write is not None else None
            for f in futures:
                if error is not None:
                    f.set_exception(error)
                else:
                    f.set_result(path)
            if error is None:
                self._refresh_catalog()
                self._emit("saved", checkpoint=str(path))
            self._publish()

        pending = self.trainer.checkpoint_writer.pending
        if self.trainer.args.save_async and pending is not None and not pending.done():
            pending.add_done_callback(published)  # save_async: done once the files are published
        else:
            published()

    def _on_health(self, kind: str, record: dict[str, Any]) -> None:
        """A hang, its end or a straggler the health watchdog found (its thread), or an
        evaluation's out-of-memory cut: an event, and a snapshot that says so at once."""
        self._emit(kind, **record)
        self._publish()

    def _health(self) -> dict[str, Any] | None:
        """The snapshot's run health: the time ledger, the newest rates, the hang under way,
        stragglers and, with several ranks, each rank's work per step against the others'."""
        trainer = self.trainer
        ledger = getattr(trainer, "ledger", None)
        if ledger is None:
            return None
        monitor = getattr(trainer, "health_monitor", None)
        latest = dict(monitor.latest) if monitor is not None else {}
        throughput = getattr(trainer, "throughput", None)
        return {"ledger": ledger.summary(), "throughput": dict(throughput.latest) if throughput is not None else {},
                "hang": latest.get("hang"), "stragglers": latest.get("stragglers"), "ranks": latest.get("ranks")}

    def _set_status(self, status: Status, only_from: tuple[Status, ...] | None = None) -> None:
        with self._lock:
            if only_from is not None and self._status not in only_from:
                return
            if self._status == status:
                return
            self._status = status
        self._publish()

    def _log_event(self, event: str, **fields: Any) -> None:
        """Append ``event`` to the run's events.jsonl (main process only)."""
        if self.trainer.is_world_process_zero():
            EventFile(self.trainer.args.output_dir).write(event, self.trainer.state.global_step, **fields)

    def _emit(self, kind: str, **data: Any) -> None:
        self._events.emit(kind, self.trainer.state.global_step, **data)

    def _publish(self) -> None:
        # Serialized, so a thread that read older values can never overwrite a newer snapshot.
        with self._lock:
            self._publish_locked()

    def _interventions(self, records: Any) -> tuple[Intervention, ...]:
        """The guard's records as value types, rebuilt only when they changed (they are few
        and change rarely; a snapshot is published several times a second)."""
        # Records are only appended (a rollback fills its own in before it is published).
        key = (len(records), records[-1].get("step"), records[-1].get("restored_step")) if records else (0,)
        cached = self._interventions_cache
        if cached is None or cached[0] != key:
            # The newest only: every poll of every client carries them (guard_interventions counts all).
            newest = records[-SNAPSHOT_INTERVENTIONS:]
            cached = self._interventions_cache = (key, tuple(Intervention.from_record(r) for r in newest))
        return cached[1]

    def _planned_lr(self) -> tuple[tuple[int, float], ...]:
        """The snapshot's ``lr_plan``, computed again only when the step, the schedule or
        max_steps changed (a few hundred multiplier calls; snapshots come ten times a second)."""
        from workbench.core.schedule_edits import planned_rates

        trainer = self.trainer
        scheduler = trainer.lr_scheduler
        lambdas = getattr(scheduler, "lr_lambdas", None)
        if not lambdas:
            return ()
        key = (scheduler.last_epoch, trainer.state.max_steps, tuple(scheduler.base_lrs), id(lambdas[0]))
        cached = getattr(self, "_lr_plan_cache", None)
        if cached is None or cached[0] != key:
            try:
                plan = planned_rates(trainer)
            except Exception:  # noqa: BLE001 - a user's schedule function failing here must not stop a publish
                plan = ()
            cached = self._lr_plan_cache = (key, plan)
        return cached[1]

    def _publish_locked(self) -> None:
        from workbench.session.progress import progress

        state, args = self.trainer.state, self.trainer.args
        interventions = (self.trainer.workbench_state.guard or {}).get("interventions", ())
        self._snapshot = replace(
            self._snapshot,
            status=self._status,
            step=state.global_step,
            max_steps=state.max_steps,
            epoch=state.epoch,
            **progress(self.trainer, self._started_at, self._start_step, self._pause_clock),
            memory=self._memory,
            checkpoints=self._catalog,
            series=self._series.frozen(),
            best_metric=state.best_metric,
            best_step=state.best_global_step,
            edits=tuple(dict(e) for e in self._edits[-SNAPSHOT_EDITS:]), edit_count=len(self._edits),
            guard_interventions=len(interventions),
            interventions=self._interventions(interventions),
            error=f"{type(self._error).__name__}: {self._error}" if self._error is not None else None,
            stop_reason=self.trainer.stop_decision.reason if self.trainer.stop_decision.is_set() else None,
            traceback=self._traceback,
            run_name=args.run_name or str(args.output_dir),
            output_dir=str(args.output_dir),
            device=str(self.trainer.accelerator.device),
            updated=time.time(),
            health=self._health(),
            lr_plan=self._planned_lr(),
            fork=self._fork_snapshot(),
            proposals=self._proposal_book.all(),
        )
