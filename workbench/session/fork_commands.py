"""A Session's A/B forks (issue 28): ``fork``, ``keep``, ``discard`` and ``fork_cost``.

``session.fork({"a": {"learning_rate": 1e-3}, "b": {"schedule": "decay_now steps=50"}},
steps=50)`` on a paused run trains each variant ``steps`` steps from the pause on the same
batches and random streams (train/forking.py), evaluates it quietly, and puts the run back
at the pause. The report (plain data: each variant's loss per step, its evaluation, the
fingerprints of its batches) is returned and published in the snapshot (``fork``), so the
dashboard and the panel draw the variants over the parent's curves. Then ``keep("b")``
continues the run from variant b's end state (its change recorded as a live edit, with the
fork's numbers in the reason) or ``discard()`` (or a plain resume) continues from the pause
unchanged. A fork's memory (k + 1 copies of weights and optimizer state, in host memory) is
reported before it starts and refused past the limit, with the figure. With several
processes every rank forks, keeps and discards with rank 0, at the paused ranks' heartbeat.

A mixin of :class:`workbench.session.local.Session`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workbench.core.edits import check_reason, validate_edits
from workbench.core.event_file import EventFile
from workbench.door.values import Status

__all__ = ["ForkCommands", "MAX_VARIANTS", "MAX_FORK_STEPS"]

MAX_VARIANTS = 8  # variants of one fork: they train one after another, and each holds a copy
MAX_FORK_STEPS = 100_000
_HOST_SHARE = 0.5  # the part of the host's available memory a fork may take unless told otherwise


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class ForkCommands:
    """The fork commands of a Session (mixed into it)."""

    def _check_variants(self, variants: Any, steps: Any) -> dict[str, dict[str, Any]]:
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_FORK_STEPS:
            raise ValueError(f"fork: steps: expected a whole number from 1 to {MAX_FORK_STEPS}, got {steps!r}")
        if not isinstance(variants, Mapping) or not variants:
            raise ValueError('fork: expected variants by name, e.g. {"a": {"learning_rate": 1e-3}, "b": {}}')
        if len(variants) > MAX_VARIANTS:
            raise ValueError(f"fork: {len(variants)} variants; at most {MAX_VARIANTS}")
        checked = {}
        for name, changes in variants.items():
            if not isinstance(name, str) or not name.strip() or len(name) > 40:
                raise ValueError(f"fork: a variant's name must be a short text, got {name!r}")
            if not isinstance(changes, Mapping):
                raise ValueError(f"fork: variant {name}: expected its live edits, e.g. {{\"learning_rate\": 1e-3}}")
            try:  # {} is the parent unchanged: a control
                checked[name] = validate_edits(changes, self.trainer.state.global_step) if changes else {}
            except ValueError as exc:
                raise ValueError(f"fork: variant {name}: {exc}") from None
        return checked

    def fork_cost(self, variants: Mapping[str, Mapping[str, Any]], steps: int,
                  max_memory: int | None = None) -> dict[str, Any]:
        """What a fork would hold in host memory, checked before it starts: ``bytes_each`` (one
        copy of weights and optimizer state), ``ranks`` (this run's processes on this machine:
        each holds its own copies), ``bytes`` (k + 1 copies on each of them), ``limit``
        (``max_memory``, else half the host's available memory), ``fits``."""
        from workbench.train.forking import fork_memory, host_available, ranks_on_this_host

        checked = self._check_variants(variants, steps)
        if self.trainer.optimizer is None:
            raise RuntimeError("fork: the run has no optimizer yet; start it and pause it first")
        each, ranks = fork_memory(self.trainer), ranks_on_this_host()
        available = host_available()
        limit = int(max_memory) if max_memory is not None else int(available * _HOST_SHARE) if available else None
        total = each * (len(checked) + 1) * ranks
        return {"variants": len(checked), "steps": steps, "bytes_each": each, "ranks": ranks, "bytes": total,
                "available": available, "limit": limit, "fits": limit is None or total <= limit}

    def fork(self, variants: Mapping[str, Mapping[str, Any]], steps: int, evaluate: bool = True,
             max_memory: int | None = None) -> dict[str, Any]:
        """Train each variant (live edits by name; ``{}`` is the parent unchanged) ``steps``
        steps from the paused run, on the same batches and random streams, evaluate it, and
        put the run back at the pause; returns the report (see the module docstring). Then
        ``keep(name)`` or ``discard()``. Refused unless paused, with one line; refused with the
        figure when the copies would not fit in ``max_memory``. With several processes every
        rank forks with rank 0 (the paused ranks' heartbeat carries it)."""
        self._require_main("fork")
        checked = self._check_variants(variants, steps)
        with self._lock:
            if self._status != Status.PAUSED or self.trainer.loop is None:
                raise RuntimeError(f"fork: pause the run first (it is {self._status})")
            cost = self.fork_cost(checked, steps, max_memory)
            if not cost["fits"]:
                ranks = f", on each of {cost['ranks']} ranks of this machine" if cost["ranks"] > 1 else ""
                raise RuntimeError(f"fork: {cost['variants']} variants need {_mib(cost['bytes'])} of host memory "
                                   f"({cost['variants'] + 1} copies of weights and optimizer state, "
                                   f"{_mib(cost['bytes_each'])} each{ranks}); the limit is {_mib(cost['limit'])}")
            self._fork_count = ident = getattr(self, "_fork_count", 0) + 1
            order = {"id": ident, "variants": checked, "steps": steps, "evaluate": evaluate, "cost": cost}
            if self._sync is None:
                return self._fork_now(order)
            future = self._queue_paused_action("fork", order)  # run by every rank at the next heartbeat
        return future.result()

    def _fork_now(self, order: dict[str, Any]) -> dict[str, Any]:
        """The fork itself, in the thread that holds the pause (the lock held)."""
        from workbench.train.forking import fork_variants

        trainer, ident, steps = self.trainer, order["id"], order["steps"]
        self._fork_ends = {}
        report: dict[str, Any] = {"id": ident, "step": trainer.state.global_step, "steps": steps,
                                  "memory": order["cost"], "state": "training", "parent": {}, "variants": {},
                                  "kept": None}
        self._fork_report = report
        self._emit("fork_started", id=ident, variants=list(order["variants"]), steps=steps,
                   bytes=order["cost"]["bytes"])
        try:
            self._fork_ends = fork_variants(trainer, report, order["variants"], steps, order["evaluate"],
                                            after_each=self._publish)
        except BaseException:
            report["state"] = "failed"
            raise
        report["state"] = "done"
        self._publish()
        self._emit("forked", id=ident, from_step=report["step"], steps=steps,
                   results={n: {"loss": v["final_loss"], **v["eval"]} for n, v in report["variants"].items()})
        return _plain(report)

    def keep(self, name: str, reason: str | None = None) -> dict[str, Any]:
        """Continue the run from variant ``name``'s end state: its change becomes a live edit of
        the run (the record's reason names the fork and its numbers), the data goes on from
        where the variant stopped. The run stays paused there (resume() continues)."""
        self._require_main("keep")
        reason = check_reason(reason)
        with self._lock:
            report = self._held_variant("keep", name)
            why = _why(report, name, "kept", reason)
            kept = {"step": report["variants"][name]["end_step"], "time": time.time(), "reason": why,
                    "fork": {"id": report["id"], "kept": name, "from_step": report["step"], "steps": report["steps"]}}
            order = {"name": name, "why": why, "kept": kept}
            if self._sync is None:
                return self._keep_now(order)
            future = self._queue_paused_action("keep", order)
        return future.result()

    def _held_variant(self, command: str, name: str) -> dict[str, Any]:
        """The fork's report, when variant ``name``'s end state is held and the run paused (the
        lock held); else the one-line refusal."""
        report = getattr(self, "_fork_report", None)
        ends = getattr(self, "_fork_ends", {})
        if report is None or report["state"] != "done" or not ends:
            raise RuntimeError(f"{command}: no fork whose variants are held (fork first, while paused; "
                               "keep and discard drop them)")
        if name not in ends:
            raise ValueError(f"{command}: no variant {name!r}; the fork has {', '.join(ends)}")
        if self._status != Status.PAUSED or self.trainer.loop is None:
            raise RuntimeError(f"{command}: the run is {self._status}; pause it first")
        return report

    def _keep_now(self, order: dict[str, Any]) -> dict[str, Any]:
        from workbench.train.forking import keep_variant

        trainer, report = self.trainer, self._fork_report
        added = keep_variant(trainer, self._fork_ends[order["name"]], order["why"], order["kept"])
        for record in added:
            self._edits.append(record)
            changes = {k: v for k, v in record.items() if k not in ("step", "time")}
            if trainer.is_world_process_zero():
                EventFile(trainer.args.output_dir).write("edit", record["step"], **changes)
            self._emit("edited", **changes)
        report.update(state="kept", kept=order["name"])
        self._fork_ends = {}
        self._publish()
        return dict(added[-1])

    def save_variant(self, name: str, output_dir: str | Path | None = None, reason: str | None = None) -> str:
        """Write variant ``name``'s end state as a checkpoint in ``output_dir`` (a new or empty
        folder of its own; by default ``OUTPUT_DIR-forkN-NAME`` beside the run's) and return its
        path; the run stays at the pause and the fork undecided (keep or discard after, as
        before). The checkpoint is the one a run that had kept the variant would write at its
        last step, so resuming it (``--resume PATH``, ``train(resume_from_checkpoint=PATH)``,
        ``branch(PATH, ...)``) continues that variant bitwise; its log history ends at the pause
        (train/fork_save.py)."""
        from workbench.session.branching import check_new_folder
        from workbench.train.fork_save import saved_record

        self._require_main("save_variant")
        reason = check_reason(reason)
        with self._lock:
            report = self._held_variant("save_variant", name)
            beside = f"{Path(self.trainer.args.output_dir).resolve()}-fork{report['id']}-{name}"
            folder = check_new_folder("save_variant", self.trainer.args.output_dir,
                                      beside if output_dir is None else output_dir, beside, "a saved variant")
            why = _why(report, name, "saved", reason)
            order = {"name": name, "folder": str(folder), "why": why,
                     "record": saved_record(report, name, folder, why)}
            if self._sync is None:
                return self._save_variant_now(order)
            future = self._queue_paused_action("save_variant", order)
        return future.result()

    def _save_variant_now(self, order: dict[str, Any]) -> str:
        from workbench.train.fork_save import save_variant

        report, name = self._fork_report, order["name"]
        path = save_variant(self.trainer, self._fork_ends[name], Path(order["folder"]), order["why"], order["record"])
        report.setdefault("saved", {})[name] = str(path)
        said = {"id": report["id"], "variant": name, "path": str(path)}
        if self.trainer.is_world_process_zero():  # the run's own history says where its variant went
            EventFile(self.trainer.args.output_dir).write("fork_saved", report["step"], **said)
        self._emit("fork_saved", **said)
        self._publish()
        return str(path)

    def discard(self) -> None:
        """Drop the fork's variants: the run continues from the pause point unchanged (it was
        put back there after the last variant; nothing of them reached disk)."""
        self._require_main("discard")
        with self._lock:
            report = getattr(self, "_fork_report", None)
            if report is None or report["state"] != "done":
                return
            if self._sync is None:
                self._discard_now({})
                return
            future = self._queue_paused_action("discard", {})
        future.result()

    def _discard_now(self, _order: dict[str, Any]) -> None:
        report = self._fork_report
        report["state"] = "discarded"
        self._fork_ends = {}
        self._emit("fork_discarded", id=report["id"])
        self._publish()

    def _fork_snapshot(self) -> dict[str, Any] | None:
        """The latest fork's report as the snapshot carries it."""
        report = getattr(self, "_fork_report", None)
        if report is None:
            return None
        key = (report["id"], report["state"], len(report["variants"]), len(report.get("saved", ())))
        cached = getattr(self, "_fork_plain", None)
        if cached is None or cached[0] != key:  # snapshots come ten times a second; forks change rarely
            cached = self._fork_plain = (key, _plain(report))
        return cached[1]


def _why(report: dict[str, Any], name: str, done: str, reason: str | None) -> str:
    """The reason a kept or saved variant's records carry: ``fork 1: kept b after 50 steps
    from step 200 (eval_loss 0.53 vs a 0.61); REASON``."""
    numbers = _numbers(report, name)
    return (f"fork {report['id']}: {done} {name} after {report['steps']} steps from step {report['step']}"
            + (f" ({numbers})" if numbers else "") + (f"; {reason}" if reason else ""))


def _numbers(report: dict[str, Any], kept: str) -> str:
    """``eval_loss 0.53 vs a 0.61, c 0.58`` (or the final train loss without evaluations)."""
    variants = report["variants"]
    metric = "eval_loss" if all("eval_loss" in v["eval"] for v in variants.values()) else None

    def value(v: dict[str, Any]) -> Any:
        return v["eval"].get(metric) if metric else v["final_loss"]

    own = value(variants[kept])
    if own is None:
        return ""
    others = ", ".join(f"{n} {value(v):.4g}" for n, v in variants.items() if n != kept and value(v) is not None)
    return f"{metric or 'loss'} {own:.4g}" + (f" vs {others}" if others else "")


def _plain(report: dict[str, Any]) -> dict[str, Any]:
    """The report as plain data (lists, not tuples: it crosses the control protocol as JSON)."""
    out = {k: v for k, v in report.items() if k != "variants"}
    out["variants"] = {n: {**v, "loss": [list(p) for p in v["loss"]], "changes": dict(v["changes"]),
                           "eval": dict(v["eval"]), "batches": list(v["batches"])}
                       for n, v in report["variants"].items()}
    out["memory"] = dict(report["memory"])
    out["parent"] = {k: dict(v) for k, v in report["parent"].items()}
    out["saved"] = dict(report.get("saved", {}))  # variant -> checkpoint path, of those saved on purpose
    return out
