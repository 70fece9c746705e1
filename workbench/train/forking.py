"""A/B forks from a paused run (issue 28): the mechanics, without the Session's bookkeeping.

Rank 0's Session runs them (session/fork_commands.py); with several processes every other
rank runs the same ones at the same time, told through the paused ranks' heartbeat
(:func:`follow_fork`), so the variants' collectives (DDP's all-reduce, the evaluation's
gathers) meet and every replica ends where rank 0's does.

From the boundary where the run is paused, each variant (a set of live edits) trains the
same ``steps`` optimizer steps on the same batches with the same random streams, one after
another on the same device, and is evaluated; the run is put back at the boundary after
each. Everything lives in host memory, as the guard's rollback points do
(workbench/guard/ring.py: weights, optimizer, schedule, RNG, counters, position), plus what
a live edit can change besides (the schedule's multipliers, max_steps, the edit records).

The variants train outside the loop, with the loop's own pieces in the loop's order
(``training_step`` per micro-batch, clipping, the optimizer and scheduler steps), but no
callbacks, gates, logs, saves or guard: nothing of a variant reaches disk or the run's
history. Their batches come from an iterator of their own over the run's loader, started at
the run's position as a resumed run starts it (the order is a function of seed and epoch),
so the paused loop's own iterator is left exactly where it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from workbench.core.rng import rng_preserved
from workbench.core.trainer_utils import unwrap_model
from workbench.guard.ring import RollbackPoint
from workbench.train.loop import batch_size, next_micro_batches

if TYPE_CHECKING:
    from workbench.core.run import Run

__all__ = ["Boundary", "fork_memory", "host_available", "train_variant", "quiet_evaluate", "batch_digest",
           "fork_variants", "keep_variant", "follow_fork"]


@dataclass
class Boundary:
    """One step boundary of the run in host memory: a rollback point plus what live edits
    change outside the optimizer and scheduler state."""

    point: RollbackPoint
    lambdas: list[Any] | None
    max_steps: int
    num_train_epochs: float
    live_edits: list[dict[str, Any]]
    # The run's LoopPosition object itself: the paused loop holds it (a local of its step), so
    # a restore writes into it rather than replacing it.
    holder: Any = None

    @classmethod
    def take(cls, run: "Run") -> "Boundary":
        """Copy the run's state at this boundary (blocks for the device-to-host copies)."""
        scheduler = run.lr_scheduler
        lambdas = getattr(scheduler, "lr_lambdas", None)
        return cls(point=RollbackPoint.take(run, {}), lambdas=list(lambdas) if lambdas is not None else None,
                   max_steps=run.state.max_steps, num_train_epochs=run.state.num_train_epochs,
                   live_edits=[dict(e) for e in run.workbench_state.live_edits], holder=run.position)

    def restore(self, run: "Run") -> None:
        """Put the run back at this boundary (the boundary stays usable for another restore)."""
        self.point.restore(run)  # (it hands the optimizer copies: the boundary stays intact)
        restored, run.position = run.position, self.holder
        for item in dataclasses.fields(restored):
            setattr(self.holder, item.name, getattr(restored, item.name))
        if self.lambdas is not None:
            run.lr_scheduler.lr_lambdas = list(self.lambdas)
        run.state.max_steps = self.max_steps
        run.state.num_train_epochs = self.num_train_epochs
        run.workbench_state.live_edits = [dict(e) for e in self.live_edits]

    @property
    def nbytes(self) -> int:
        """Host bytes of the copied tensors."""
        return _nbytes(self.point.model) + _nbytes(self.point.optimizer)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def fork_memory(run: "Run") -> int:
    """Host bytes one copy of the run's state takes (weights and optimizer state, as they are
    now): a fork of k variants holds k + 1 of them (the pause point and each variant's end)."""
    model = unwrap_model(run.model)
    optimizer = getattr(run.optimizer, "optimizer", run.optimizer)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state = _nbytes(optimizer.state_dict()["state"]) if optimizer is not None else 0
    return weights + state


def host_available() -> int:
    """Host memory available now, in bytes (MemAvailable; 0 when it cannot be read)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no psutil, or no reading: the caller's limit decides alone
        return 0


def batch_digest(micro: list[Any]) -> str:
    """A short fingerprint of a step's micro-batches (their tensors' bytes): variants that
    trained on the same batches show the same one."""
    digest = hashlib.sha1()

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(value, dict) or hasattr(value, "items"):
            for key in sorted(value.keys()):
                digest.update(str(key).encode())
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                feed(item)

    feed(micro)
    return digest.hexdigest()[:12]


def _iterator(run: "Run", loop: Any, epoch: int, skip: int) -> Any:
    """An iterator over the run's batches from micro-batch ``skip`` of ``epoch``, as the loop
    starts one (the epoch's order and generator; the epoch-start draw when it starts at 0)."""
    from workbench.data.samplers import draw_iterator_seed, start_loader_epoch

    args = run.args
    loader = loop.loader
    start_loader_epoch(loader, epoch, args.data_seed if args.data_seed is not None else args.seed)
    if skip:
        from accelerate import skip_first_batches

        return iter(skip_first_batches(loader, skip))
    draw_iterator_seed(loader, epoch)
    return iter(loader)


@contextlib.contextmanager
def _loader_kept(run: "Run", loop: Any) -> Any:
    """Leave the loader's epoch and generator as the paused loop's own iterator has them."""
    from workbench.data.samplers import start_loader_epoch

    generator = getattr(loop.loader, "generator", None)
    saved = generator.get_state() if isinstance(generator, torch.Generator) else None
    epoch = run.position.epoch
    try:
        yield
    finally:
        args = run.args
        start_loader_epoch(loop.loader, epoch, args.data_seed if args.data_seed is not None else args.seed)
        if saved is not None:
            generator.set_state(saved)


def _optimizer_step(run: "Run", loop: Any) -> None:
    """The loop's optimizer step, numerically: clip, step, schedule, zero the gradients."""
    from workbench.train.schedules import steps_per_update

    args, acc = run.args, run.accelerator
    if args.max_grad_norm > 0:
        if loop._clip_plain:
            torch.nn.utils.clip_grad_norm_(loop._params, args.max_grad_norm)
        else:
            acc.clip_grad_norm_(loop.model.parameters(), args.max_grad_norm)
    run.optimizer.step()
    if (loop._clip_plain or not acc.optimizer_step_was_skipped) and steps_per_update(run.lr_scheduler):
        run.lr_scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)


def train_variant(run: "Run", steps: int) -> dict[str, Any]:
    """Train ``steps`` optimizer steps from the run's current boundary, outside the loop;
    returns ``{"loss": [(step, loss)...], "batches": [digest per step], "seconds"}``."""
    loop = run.loop
    if loop is None:
        raise RuntimeError("fork: the run is not inside its loop (start it and pause it first)")
    args, state, position = run.args, run.state, run.position
    ga = args.gradient_accumulation_steps
    losses: list[tuple[int, float]] = []
    digests: list[str] = []
    began = time.perf_counter()
    with _loader_kept(run, loop):
        epoch, skip = position.normalized(loop.batches_per_epoch)
        iterator = _iterator(run, loop, epoch, skip)
        position.epoch, position.batch = epoch, skip
        for _ in range(steps):
            micro = next_micro_batches(iterator, ga)
            if not micro:  # the epoch ended: the next one, as the loop would start it
                position.epoch, position.batch = position.epoch + 1, 0
                iterator = _iterator(run, loop, position.epoch, 0)
                micro = next_micro_batches(iterator, ga)
                if not micro:
                    break
            digests.append(batch_digest(micro))
            num_items = loop._count_items(micro)
            total = None
            for i, inputs in enumerate(micro):
                last = i == len(micro) - 1
                with contextlib.nullcontext() if last else run.accelerator.no_sync(loop.model):
                    loss = run.training_step(loop.model, inputs, num_items)
                total = loss if total is None else total + loss
                position.samples += batch_size(inputs)
            _optimizer_step(run, loop)
            state.global_step += 1
            position.batch += len(micro)
            position.update = state.global_step
            per_epoch = loop.batches_per_epoch
            state.epoch = position.epoch + (position.batch / per_epoch if per_epoch
                                            else state.global_step / max(state.max_steps, 1))
            if total is not None and run.accelerator.num_processes > 1:  # the loss of every rank's batches
                total = run.accelerator.reduce(total.detach(), reduction="mean")
            value = float(total) if total is not None else math.nan
            losses.append((state.global_step, value))
    ledger = getattr(run, "ledger", None)
    if ledger is not None and hasattr(ledger, "enter"):
        ledger.enter("paused")  # training_step marked its backward; the run is paused again
    return {"loss": losses, "batches": digests, "seconds": time.perf_counter() - began}


def quiet_evaluate(run: "Run") -> dict[str, float]:
    """The run's evaluation sets' metrics for the current weights, told to nobody (no log, no
    callbacks, no history), every RNG stream and the train mode left as they were."""
    from workbench.core.records import is_timing_metric

    if run.eval_dataset is None:
        return {}
    model = run.model
    was_training = model.training
    targets = run.eval_dataset.items() if isinstance(run.eval_dataset, dict) else [(None, None)]
    metrics: dict[str, float] = {}
    with rng_preserved():
        try:
            for name, _dataset in targets:
                prefix = f"eval_{name}" if name is not None else "eval"
                loader = run.get_eval_dataloader(name)
                output = run.evaluation_loop(loader, "Evaluation", metric_key_prefix=prefix)
                metrics.update({k: float(v) for k, v in output.metrics.items()
                                if isinstance(v, (int, float)) and not is_timing_metric(k)})
        finally:
            model.train(was_training)
    return metrics



def run_variant(run: "Run", name: str, changes: dict[str, Any], steps: int, evaluate: bool,
                ident: int) -> dict[str, Any]:
    """One variant from the pause point: its edits (recorded in the run's state, kept only if
    the variant is), its steps, its evaluation."""
    from workbench.core.edits import apply_edit

    applied = {}
    for key, value in sorted(changes.items(), key=lambda kv: kv[0] not in ("max_steps", "num_train_epochs",
                                                                            "schedule")):
        applied[key] = apply_edit(run, key, value)
    if applied:
        run.workbench_state.live_edits.append({"step": run.state.global_step, "time": time.time(),
                                               **applied, "reason": f"fork {ident}: variant {name}"})
    room = max(0, run.state.max_steps - run.state.global_step)
    trained = train_variant(run, min(steps, room))
    metrics = quiet_evaluate(run) if evaluate else {}
    losses = trained["loss"]
    return {"changes": applied, "loss": losses, "eval": metrics, "batches": trained["batches"],
            "seconds": trained["seconds"], "final_loss": losses[-1][1] if losses else None,
            "end_step": run.state.global_step}


def fork_variants(run: "Run", report: dict[str, Any], variants: dict[str, dict[str, Any]], steps: int,
                  evaluate: bool, after_each: Any = None) -> dict[str, Boundary]:
    """Train each of ``variants`` ``steps`` steps from the pause and evaluate it (the parent
    too, first), filling ``report["parent"]`` and ``report["variants"]``; the run is put back
    at the pause after each (and on any error). Returns each variant's end state.
    ``after_each()`` is called after each variant (the Session publishes the report)."""
    pause_point = Boundary.take(run)
    ends: dict[str, Boundary] = {}
    try:
        if evaluate:
            report["parent"] = {"eval": quiet_evaluate(run)}
        for name, changes in variants.items():
            report["variants"][name] = run_variant(run, name, changes, steps, evaluate, report["id"])
            ends[name] = Boundary.take(run)
            pause_point.restore(run)
            if after_each is not None:
                after_each()
    except BaseException:
        pause_point.restore(run)
        raise
    return ends


def keep_variant(run: "Run", end: Boundary, why: str, kept: dict[str, Any]) -> list[dict[str, Any]]:
    """Continue the run from a variant's end state: its edit records get ``why`` as their
    reason and ``kept`` (the record naming the fork) follows them; the data goes on from where
    the variant stopped. Returns the records added to the run's live edits."""
    before = len(run.workbench_state.live_edits)
    end.restore(run)
    loop = run.loop
    loop._restart = run.position.normalized(loop.batches_per_epoch)
    loop.losses.restart_at(run.state.global_step)
    records = run.workbench_state.live_edits[before:]
    for record in records:  # the variant's change, at the pause step
        record["reason"] = why
    run.workbench_state.live_edits.append(dict(kept))
    return [*records, run.workbench_state.live_edits[-1]]


def follow_fork(run: "Run", action: str, payload: dict[str, Any]) -> None:
    """On a rank other than 0: take part in rank 0's fork, keep or discard (what rank 0's
    Session decided, broadcast with the paused ranks' heartbeat)."""
    if action == "fork":
        report = {"id": payload["id"], "parent": {}, "variants": {}}
        run.fork_ends = fork_variants(run, report, payload["variants"], payload["steps"], payload["evaluate"])
    elif action == "keep":
        ends = getattr(run, "fork_ends", {})
        keep_variant(run, ends[payload["name"]], payload["why"], payload["kept"])
        run.fork_ends = {}
    elif action == "discard":
        run.fork_ends = {}
    else:
        raise ValueError(f"fork: unknown action {action!r}")
