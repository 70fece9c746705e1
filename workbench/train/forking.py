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
history while it trains. Their batches come from an iterator of their own over the run's
loader, started at the run's position as a resumed run starts it (the order is a function
of seed and epoch), so the paused loop's own iterator is left exactly where it was.

What the loop would have counted of each step (its micro-batch losses, gradient norm and
rate, tokens and FLOP) is kept with the variant's end state (:class:`KeptStep`), so that
``keep`` hands the kept variant's steps to the run's own loss log afterwards: they are logged
where the loop would have logged them (log_history, the callbacks, events.jsonl, trackers),
and ``total_flos`` and ``num_input_tokens_seen`` count them, as steps the run trained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from workbench.checkpoint.state_dicts import nested_nbytes
from workbench.core.rng import rng_preserved
from workbench.core.trainer_utils import unwrap_model
from workbench.guard.ring import RollbackPoint, rollback_weights
from workbench.train.loop import batch_size, next_micro_batches

if TYPE_CHECKING:
    from workbench.core.run import Run

__all__ = ["Boundary", "KeptStep", "fork_memory", "ranks_on_this_host", "host_available", "train_variant",
           "quiet_evaluate", "batch_digest", "fork_variants", "keep_variant", "log_kept_steps", "count_kept_steps",
           "follow_fork"]


@dataclass
class KeptStep:
    """What the loop would have counted of one of a variant's steps, held until the fork is
    kept or dropped: device tensors, no host sync (the loop's own loss log reduces them at
    its logging points)."""

    step: int
    epoch: float
    losses: list[torch.Tensor]  # each micro-batch's loss, as the loop's LossLog adds them
    grad_norm: Any  # what clipping returned (a tensor), None without clipping
    learning_rate: float  # the rate the step used, read between the optimizer and schedule steps
    flos: float
    tokens: torch.Tensor | None  # counted by the loop's own rule; None when not counted


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
    # A variant's end: the steps that led here, for the run's loss log if it is kept.
    steps: list[KeptStep] = dataclasses.field(default_factory=list)

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
        return nested_nbytes(self.point.model) + nested_nbytes(self.point.optimizer)


def fork_memory(run: "Run") -> int:
    """Host bytes one copy of the run's state takes (weights and optimizer state, as they are
    now): a fork of k variants holds k + 1 of them (the pause point and each variant's end).
    The weights are those a rollback point copies: a LoRA model's adapter, not its base."""
    model = unwrap_model(run.model)
    optimizer = getattr(run.optimizer, "optimizer", run.optimizer)
    weights = sum(t.numel() * t.element_size() for t in rollback_weights(model).values())
    state = nested_nbytes(optimizer.state_dict()["state"]) if optimizer is not None else 0
    return weights + state


def ranks_on_this_host() -> int:
    """The processes of this run on this machine (torchrun's LOCAL_WORLD_SIZE, which
    ``accelerate launch`` sets; 1 alone): each forks with its own copies in the same host
    memory, so a fork's figure is theirs together."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


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


def _optimizer_step(run: "Run", loop: Any) -> tuple[Any, float]:
    """The loop's optimizer step, numerically: clip, step, schedule, zero the gradients.
    Returns (the gradient norm, the rate the step used), which the loop would log."""
    from workbench.train.schedules import steps_per_update

    args, acc = run.args, run.accelerator
    grad_norm = None
    if args.max_grad_norm > 0:
        if loop._clip_plain:
            grad_norm = torch.nn.utils.clip_grad_norm_(loop._params, args.max_grad_norm)
        else:
            grad_norm = acc.clip_grad_norm_(loop.model.parameters(), args.max_grad_norm)
    run.optimizer.step()
    rate = run._get_learning_rate()  # before the schedule moves on, as the loop reads it
    if (loop._clip_plain or not acc.optimizer_step_was_skipped) and steps_per_update(run.lr_scheduler):
        run.lr_scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return grad_norm, rate


def _step_tokens(loop: Any, micro: list[Any], mode: str) -> torch.Tensor | None:
    """The tokens the loop would count for a step's micro-batches, by the loop's own rule
    (``_count_tokens``) into a counter of the variant's own: the loop's is left untouched."""
    if mode == "no":
        return None
    own, loop._tokens = loop._tokens, torch.zeros_like(loop._tokens)
    try:
        for inputs in micro:
            loop._count_tokens(inputs, mode)
        return loop._tokens
    finally:
        loop._tokens = own


def train_variant(run: "Run", steps: int) -> dict[str, Any]:
    """Train ``steps`` optimizer steps from the run's current boundary, outside the loop;
    returns ``{"loss": [(step, loss)...], "batches": [digest per step], "seconds",
    "steps": [KeptStep per step]}`` (the last for the run's loss log, should it be kept)."""
    loop = run.loop
    if loop is None:
        raise RuntimeError("fork: the run is not inside its loop (start it and pause it first)")
    args, state, position = run.args, run.state, run.position
    ga = args.gradient_accumulation_steps
    losses: list[tuple[int, float]] = []
    digests: list[str] = []
    kept: list[KeptStep] = []
    tokens_mode = args.include_num_input_tokens_seen
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
            step_losses: list[torch.Tensor] = []
            flos = 0.0
            for i, inputs in enumerate(micro):
                last = i == len(micro) - 1
                with contextlib.nullcontext() if last else run.accelerator.no_sync(loop.model):
                    loss = run.training_step(loop.model, inputs, num_items)
                step_losses.append(loss)
                flos += float(run.floating_point_ops(inputs))  # HF: per micro-batch, as the loop counts
                total = loss if total is None else total + loss
                position.samples += batch_size(inputs)
            tokens = _step_tokens(loop, micro, tokens_mode)
            grad_norm, rate = _optimizer_step(run, loop)
            state.global_step += 1
            position.batch += len(micro)
            position.update = state.global_step
            per_epoch = loop.batches_per_epoch
            state.epoch = position.epoch + (position.batch / per_epoch if per_epoch
                                            else state.global_step / max(state.max_steps, 1))
            kept.append(KeptStep(state.global_step, state.epoch, step_losses, grad_norm, rate, flos, tokens))
            if total is not None and run.accelerator.num_processes > 1:  # the loss of every rank's batches
                total = run.accelerator.reduce(total.detach(), reduction="mean")
            value = float(total) if total is not None else math.nan
            losses.append((state.global_step, value))
    ledger = getattr(run, "ledger", None)
    if ledger is not None and hasattr(ledger, "enter"):
        ledger.enter("paused")  # training_step marked its backward; the run is paused again
    _compact(kept)
    return {"loss": losses, "batches": digests, "seconds": time.perf_counter() - began, "steps": kept}


def _compact(kept: list[KeptStep]) -> None:
    """Put the variant's many tiny per-step tensors (losses, gradient norms, token counts) in
    one device block each, the steps holding views of it: a long fork of several variants
    would otherwise hold thousands of small device allocations until keep or discard. The
    values, and so what keep logs, are the same."""
    def packed(tensors: list[Any]) -> list[Any] | None:
        if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in tensors):
            return None
        if len({(t.dtype, t.device) for t in tensors}) != 1:
            return None
        block = torch.stack(tensors)
        return [block[i] for i in range(len(tensors))]

    losses = packed([loss for step in kept for loss in step.losses])
    if losses is not None:
        at = 0
        for step in kept:
            step.losses, at = losses[at:at + len(step.losses)], at + len(step.losses)
    for name in ("grad_norm", "tokens"):
        values = packed([getattr(step, name) for step in kept])
        if values is not None:
            for step, value in zip(kept, values):
                setattr(step, name, value)


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
                ident: int) -> tuple[dict[str, Any], list[KeptStep]]:
    """One variant from the pause point: its edits (recorded in the run's state, kept only if
    the variant is), its steps, its evaluation. Returns its report entry (plain numbers) and
    its steps as the loop would have counted them (for keep)."""
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
            "end_step": run.state.global_step}, trained["steps"]


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
            report["variants"][name], trained = run_variant(run, name, changes, steps, evaluate, report["id"])
            ends[name] = Boundary.take(run)
            ends[name].steps = trained
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
    the variant stopped, and the variant's steps are logged and counted as the run's own
    (:func:`log_kept_steps`). Returns the records added to the run's live edits."""
    before = len(run.workbench_state.live_edits)
    end.restore(run)
    loop = run.loop
    loop._restart = run.position.normalized(loop.batches_per_epoch)
    log_kept_steps(run, end.steps)
    if run.state.global_step >= run.state.max_steps:
        # The variant trained the run's last step (e.g. a decay_now): the loop, which never saw
        # that step end, stops at this boundary with the last step's evaluation and save
        # rather than train past max_steps.
        from workbench.train.callbacks import stop_at_last_step

        stop_at_last_step(run.args, run.state, run.control)
    records = run.workbench_state.live_edits[before:]
    for record in records:  # the variant's change, at the pause step
        record["reason"] = why
    run.workbench_state.live_edits.append(dict(kept))
    return [*records, run.workbench_state.live_edits[-1]]


def log_kept_steps(run: "Run", steps: list[KeptStep]) -> None:
    """Hand a kept variant's steps to the run's loss log as the loop would have, step by step:
    each micro-batch loss into the window (which still holds the losses since the last log
    before the pause), the tokens and FLOP counted, and a log (``TrainingLoop.log_loss``:
    log_history, on_log for callbacks, trackers and events.jsonl) at each logging point among
    them. So the loss log has no gap and its records equal those of a run that had made the
    variant's change at the pause. Every rank runs it at the same point (keep is followed by
    every rank), so the logging points' collectives meet."""
    loop = run.loop

    def each(kept: KeptStep, logs: bool) -> None:
        loop.losses.grad_norm, loop.losses.learning_rate = kept.grad_norm, kept.learning_rate
        if logs:
            loop.log_loss(loop.start_time, kept.learning_rate)

    count_kept_steps(run, steps, loop.losses, loop._tokens, each)


def count_kept_steps(run: "Run", steps: list[KeptStep], losses: Any, tokens: torch.Tensor,
                     each: Callable[[KeptStep, bool], None] | None = None) -> None:
    """Count a variant's steps as the loop counts its own: each micro-batch loss into
    ``losses`` (a LossLog), the tokens into ``tokens`` (in place), the FLOP into
    ``run.current_flos``; ``each(step, logs)`` after each step (``logs``: a logging point).
    The run's step and epoch are as before afterwards."""
    from workbench.train.callbacks import logs_at_step

    state = run.state
    end_step, end_epoch = state.global_step, state.epoch
    try:
        for kept in steps:
            state.global_step = kept.step - 1  # the window numbers each loss by the steps before it
            for loss in kept.losses:
                losses.add(loss)
            state.global_step, state.epoch = kept.step, kept.epoch
            run.current_flos += kept.flos
            if kept.tokens is not None:
                tokens += kept.tokens
            if each is not None:
                each(kept, logs_at_step(run.args, state, kept.step))
    finally:
        state.global_step, state.epoch = end_step, end_epoch


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
