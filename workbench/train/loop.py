"""The training loop: epochs, accumulated updates, and the log/evaluate/save points.

Everything a step does lives on the device: the running loss and gradient norm are
tensors read back only at logging points (``.item()`` is a host sync; one per log, none
per step). Callbacks steer the loop only through ``TrainerControl`` flags.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import workbench.train.losses as losses
from workbench.checkpoint.lock import check_writable
from workbench.data.samplers import draw_iterator_seed, start_loader_epoch
from workbench.train.rng import CollationRng, draws_random
from workbench.train.run_state import WorkbenchState
from workbench.train.tracking import EventLog
from workbench.train.trainer_utils import TrainOutput, has_length, speed_metrics, unwrap_model
from workbench.train.schedules import steps_per_update


__all__ = ["TrainingLoop"]

log = logging.getLogger("workbench")

Trainer = Any  # annotations only: Trainer imports this module (directly or not), so it is not imported back


class TrainingLoop:
    """One call of ``Trainer.train``: set up, run the epochs, finish."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer
        self.args = trainer.args
        self.accelerator = trainer.accelerator

    # -- set-up ------------------------------------------------------------------------

    def _plan(self, loader) -> tuple[int, int, int | None]:
        """(max_steps, num_epochs, updates_per_epoch) from the arguments and the data."""
        args = self.args
        ga = args.gradient_accumulation_steps
        if has_length(loader):
            updates_per_epoch = max(math.ceil(len(loader) / ga), 1)
            if args.max_steps > 0:
                return args.max_steps, math.ceil(args.max_steps / updates_per_epoch), updates_per_epoch
            max_steps = math.ceil(args.num_train_epochs * updates_per_epoch)
            return max_steps, math.ceil(args.num_train_epochs), updates_per_epoch
        if args.max_steps <= 0:
            raise ValueError("max_steps: the train dataset has no length (an IterableDataset), so set max_steps")
        return args.max_steps, sys.maxsize, None

    def _wrap_model(self) -> torch.nn.Module:
        trainer, args = self.trainer, self.args
        model = trainer.model
        if args.activation_checkpointing:
            enable = getattr(model, "gradient_checkpointing_enable", None)
            if enable is None:
                raise ValueError(
                    f"activation_checkpointing: {type(model).__name__} has no gradient_checkpointing_enable(); "
                    "use a model that supports it or unset activation_checkpointing"
                )
            enable(gradient_checkpointing_kwargs=args.activation_checkpointing_kwargs)
        from workbench.checkpoint.state_dicts import is_fsdp

        if is_fsdp(trainer):
            # FSDP replaces the parameters by shards: the optimizer must be prepared with the
            # model so it steps the shards.
            wrapped, trainer.optimizer = self.accelerator.prepare(model, trainer.optimizer)
            trainer.model_wrapped = wrapped
        else:
            trainer.model_wrapped = wrapped = self.accelerator.prepare(model)
            if self._optimizer_needs_wrapper():
                trainer.optimizer = self.accelerator.prepare(trainer.optimizer)
        if args.torch_compile:
            kwargs = {k: v for k, v in (("backend", args.torch_compile_backend), ("mode", args.torch_compile_mode)) if v}
            wrapped = torch.compile(wrapped, **kwargs)
            trainer.model_wrapped = wrapped
        return wrapped

    def _optimizer_needs_wrapper(self) -> bool:
        """Accelerate's optimizer wrapper is needed for loss scaling and sharded engines only.

        Elsewhere it adds per-step work (package probes on every step()) and nothing else:
        gradients are synchronized by DDP and accumulation is handled by this loop.
        """
        from accelerate.utils import DistributedType

        acc = self.accelerator
        plain = acc.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
        return not plain or acc.scaler is not None

    # -- the run ---------------------------------------------------------------------------

    def run(self, checkpoint: Path | None, ignore_keys_for_eval: list[str] | None) -> TrainOutput:
        """Train from the start, or from ``checkpoint`` (a folder the store resolved and verified)."""
        trainer, args, acc = self.trainer, self.args, self.accelerator
        from workbench.checkpoint.store import CheckpointStore
        from workbench.checkpoint.trainer_state import load_training_state
        from workbench.train.edits import replay_edits
        from workbench.train.resume_args import apply_changed_arguments

        store = CheckpointStore(args.output_dir)
        if acc.is_main_process:
            check_writable(store.root)
        loader = trainer.get_train_dataloader()
        self.collation = _track_collation(loader, args.gradient_accumulation_steps)
        self._trained = 0  # batches of the current iterator that training has taken
        replay: list[dict[str, Any]] = []
        max_steps, num_epochs, updates_per_epoch = self._plan(loader)
        trainer._updates_per_epoch = updates_per_epoch  # live epoch edits convert with it
        trainer.create_optimizer_and_scheduler(max_steps)
        model = self._wrap_model()
        self._clip_plain = not self._optimizer_needs_wrapper()
        self._averaging = args.average_tokens_across_devices and acc.num_processes > 1
        self._mean_is_enough = not self._averaging and trainer.compute_loss_func is None  # see _count_items
        # No loss scaling or engine: training_step can call loss.backward() itself.
        trainer._plain_backward = self._clip_plain
        self._params = [p for p in model.parameters() if p.requires_grad]
        from workbench.train.guard import GuardMonitor, guard_for

        guard = guard_for(trainer)
        # None when the guard is off: the per-step cost is then one `is not None` check.
        self.guard: GuardMonitor | None = None
        if guard is not None:
            self.guard = GuardMonitor(guard, trainer.optimizer, acc.device, acc.num_processes,
                                      allow_found_inf=self._clip_plain)
            from workbench.data.order import DataOrder

            # The rows of a bad step are recomputed when one is recorded, never per step.
            self.guard.order = DataOrder(loader, len(loader) if has_length(loader) else None)
        # Rollback's ring of in-memory snapshots (None unless an action is rollback).
        self.snapshots = None
        self._restart: tuple[int, int] | None = None  # set by a rollback: where the data resumes
        self._rollback_due: list[dict[str, Any]] = []  # rollbacks read outside a guard point
        self._batches_per_epoch = len(loader) if has_length(loader) else None
        if guard is not None and guard.rolls_back:
            from workbench.checkpoint.snapshots import SnapshotRing
            from workbench.checkpoint.state_dicts import is_fsdp

            if is_fsdp(trainer):
                raise ValueError("guard: rollback keeps full host copies per process and does not support FSDP; "
                                 "use skip, pause or stop")
            self.snapshots = SnapshotRing(guard.snapshot_every, guard.snapshots)
        trainer.callback_handler.optimizer = trainer.optimizer
        trainer.callback_handler.lr_scheduler = trainer.lr_scheduler
        trainer.callback_handler.train_dataloader = loader
        trainer.callback_handler.model = trainer.model

        state = trainer.state.__class__(
            is_local_process_zero=trainer.is_local_process_zero(),
            is_world_process_zero=trainer.is_world_process_zero(),
        )
        state.train_batch_size = trainer._train_batch_size
        state.compute_steps(args, max_steps)
        state.max_steps = max_steps
        state.num_train_epochs = num_epochs if num_epochs != sys.maxsize else 0
        trainer.state = state
        trainer.workbench_state = WorkbenchState()
        trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        if checkpoint is not None:
            replay = load_training_state(trainer, checkpoint)
            state = trainer.state
            state.max_steps = max_steps
            replay_edits(trainer)  # a live max_steps edit outlives the restart
            if self.guard is not None and trainer.workbench_state.guard:
                self.guard.restore(trainer.workbench_state.guard)  # the detector decides as the uninterrupted run
            # This launch's arguments where they differ from the checkpoint's: warned about,
            # and the live-editable ones applied from here as a recorded edit (resume_args.py).
            apply_changed_arguments(trainer, checkpoint, max_steps)
        if acc.is_main_process:
            store.clean_temporaries()

        from workbench.train.loss_window import LossWindow

        self.window = LossWindow(acc.device, args.logging_nan_inf_filter)
        self.total_loss = 0.0
        self.last_logged = state.global_step
        if checkpoint is not None:
            self._restore_window(trainer.workbench_state.loss_window)
        # The Trainer's step-end hooks and every save (wherever asked for) reach this run through it.
        trainer._training_loop = self
        self.grad_norm: torch.Tensor | None = None
        # The rate the last optimizer step used, read before the schedule moves on: what HF
        # logs for that step (None until a step of this call ran).
        self.learning_rate: float | None = None
        trainer.current_flos = 0
        self._tokens = torch.zeros((), dtype=torch.long, device=acc.device)
        trainer._memory_stage("train", start=True)
        start_time = time.perf_counter()
        start_step = state.global_step
        control = trainer.callback_handler.on_train_begin(args, state, trainer.control)
        trainer.control = control
        if state.global_step >= max_steps:
            control.should_training_stop = True  # resumed from the last step: nothing left to train
        if args.eval_on_start and state.global_step == 0:
            trainer._evaluate(None, ignore_keys_for_eval, skip_scheduler=True)
            if trainer.control.should_save:  # a stop was requested during that evaluation
                self._log_save_evaluate(model, ignore_keys_for_eval, start_time)

        epochs_done, skip_batches = 0, 0
        if updates_per_epoch:
            # As HF: finished epochs are never repeated; ignore_data_skip only restarts the
            # current epoch at its first batch (so state.epoch keeps going forward).
            epochs_done = state.global_step // updates_per_epoch
            if not args.ignore_data_skip:
                skip_batches = (state.global_step % updates_per_epoch) * args.gradient_accumulation_steps
        if self.guard is not None and self.guard.skipped and self.guard.position is not None:
            # A rollback jumped over data: the position is the checkpoint's, not the step's.
            epochs_done = self.guard.position[0]
            skip_batches = 0 if args.ignore_data_skip else self.guard.position[1]
        if self.guard is not None:
            self.guard.position = (epochs_done, skip_batches)
        if self.snapshots is not None and self.snapshots.due(state.global_step):
            self._take_snapshot()
        epoch, skip = epochs_done, skip_batches
        self._replay = replay if self.collation is not None else []
        # Re-planned each epoch: a live max_steps / num_train_epochs edit (or its replay on
        # resume) can need more epochs than the arguments planned, and so can data a
        # rollback skipped.
        while epoch < self._epochs_planned(updates_per_epoch, num_epochs):
            if trainer.control.should_training_stop:
                break
            self._run_epoch(model, loader, epoch, skip, updates_per_epoch, ignore_keys_for_eval, start_time)
            if self._restart is not None:  # a rollback: carry on from its data position
                (epoch, skip), self._restart = self._restart, None
                continue
            if trainer.control.should_training_stop:
                break
            epoch, skip = epoch + 1, 0
        return self._finish(start_time, start_step)

    def _epochs_planned(self, updates_per_epoch: int | None, num_epochs: int) -> int:
        """Epochs the loop may enter: enough for max_steps, plus the data rollbacks skipped
        (an overestimate is harmless: the run stops at max_steps)."""
        if not updates_per_epoch:
            return num_epochs
        planned = math.ceil(self.trainer.state.max_steps / updates_per_epoch)
        skipped = self.guard.skipped if self.guard is not None else 0
        if skipped and self._batches_per_epoch:
            planned += math.ceil(skipped / self._batches_per_epoch) + 1
        return planned

    def _run_epoch(self, model, loader, epoch: int, skip: int, updates_per_epoch: int | None,
                   ignore_keys: list[str] | None, start_time: float) -> None:
        trainer, args, acc = self.trainer, self.args, self.accelerator
        state = trainer.state
        handler = trainer.callback_handler
        # Samplers, collator and generator are found through the loader itself, so a
        # get_train_dataloader override is seeded per epoch like the built-in loader.
        start_loader_epoch(loader, epoch, args.data_seed if args.data_seed is not None else args.seed)
        if not skip:
            draw_iterator_seed(loader, epoch)  # HF's loader draws this as the epoch starts
        iterator_source = loader
        if skip:
            from accelerate import skip_first_batches

            iterator_source = skip_first_batches(loader, skip)
        trainer.control = handler.on_epoch_begin(args, state, trainer.control)
        ga = args.gradient_accumulation_steps
        batches_in_epoch = len(loader) if has_length(loader) else None
        if self.collation is not None:
            self.collation.restart()
            if self._replay:  # the batches the checkpoint's run had collated, drawn as it drew them
                self.collation.replay(self._replay)
                self._replay = []
        self._trained = 0
        iterator = iter(iterator_source)
        step_in_epoch = skip  # micro-batches consumed in this epoch
        count_tokens = args.include_num_input_tokens_seen
        guard = self.guard
        while not trainer.control.should_training_stop:
            micro = []
            for _ in range(ga):
                try:
                    micro.append(next(iterator))
                except StopIteration:
                    break
            if not micro:
                break
            num_items = self._count_items(micro)
            trainer.last_inputs = micro[-1]  # for inspection while paused (a reference, no copy)
            trainer.control = handler.on_step_begin(args, state, trainer.control)
            if trainer.control.should_training_stop:
                # Stopped before this step ran (e.g. while paused at its start): save the
                # state of the boundary if asked, and leave the fetched batches untouched.
                self._log_save_evaluate(model, ignore_keys, start_time)
                break
            self._trained += len(micro)
            last = len(micro) - 1
            for i, inputs in enumerate(micro):
                if count_tokens != "no":
                    self._count_tokens(inputs, count_tokens)
                # Accumulating micro-batches skip the gradients' all-reduce (a no-op with one process).
                sync = contextlib.nullcontext() if i == last else acc.no_sync(model)
                with sync:
                    loss = trainer.training_step(model, inputs, num_items)
                trainer.current_flos += float(trainer.floating_point_ops(inputs))  # HF: per micro-batch
                # Remembered, not added: the window sums (and NaN-filters) at the logging point.
                self.window.add(loss, state.global_step - self.last_logged)
                if guard is not None:
                    guard.add_loss(loss)
                step_in_epoch += 1
                if i != last:
                    trainer.control = handler.on_substep_end(args, state, trainer.control)
            self._optimizer_step(model)
            state.global_step += 1
            if batches_in_epoch:
                state.epoch = epoch + step_in_epoch / batches_in_epoch
            else:
                state.epoch = epoch + state.global_step / state.max_steps
            if guard is not None:
                guard.end_step(state.global_step, epoch, step_in_epoch - len(micro), step_in_epoch - 1)
                guard.position = (epoch, step_in_epoch)
            trainer.control = handler.on_step_end(args, state, trainer.control)
            if guard is not None:
                self._guard_point()
                if self._restart is not None:  # rolled back: this epoch's iterator is stale; run() restarts the data
                    self._stop_after_rollback(model, ignore_keys, start_time)
                    return
                if self.snapshots is not None and self.snapshots.due(state.global_step):
                    self._take_snapshot()
            self._log_save_evaluate(model, ignore_keys, start_time)
            if trainer.control.should_epoch_stop or trainer.control.should_training_stop:
                break
        trainer.control = handler.on_epoch_end(args, state, trainer.control)
        if guard is not None:
            # An epoch-end save or evaluation reads the guard first, as a step end does: a
            # checkpoint must never hold a rollback still to be carried out (a resume from it
            # would not know to).
            self._guard_point()
            if self._restart is not None:
                self._stop_after_rollback(model, ignore_keys, start_time)
                return
        self._log_save_evaluate(model, ignore_keys, start_time)

    def _stop_after_rollback(self, model, ignore_keys: list[str] | None, start_time: float) -> None:
        """A rollback that also stops the run (max_interventions, no progress) saves the
        restored boundary: run() leaves before the data restarts."""
        if self.trainer.control.should_training_stop:
            self._log_save_evaluate(model, ignore_keys, start_time)

    def pending_batches(self) -> list[dict[str, Any]]:
        """The host random streams of batches collated but not trained yet (rng.CollationRng),
        for a checkpoint written at this boundary."""
        return self.collation.pending(self._trained) if self.collation is not None else []

    def _count_items(self, micro: list[Mapping[str, Any]]) -> torch.Tensor | None:
        """Targets across the accumulated batch (and across processes when averaging).

        With one micro-batch on one process (or no averaging across them) the count only
        turns a mean into the same mean, so it is skipped, unless a compute_loss_func
        asked to receive it.
        """
        if len(micro) == 1 and self._mean_is_enough:
            return None
        # Any Mapping is a batch of named inputs (HF's collators return BatchEncoding, a UserDict).
        if not micro or not isinstance(micro[0], (dict, Mapping)) or "labels" not in micro[0]:
            return None
        kind = self.trainer.model_kind
        total = losses.count_target_items(micro[0]["labels"], kind)
        for batch in micro[1:]:
            total = total + losses.count_target_items(batch["labels"], kind)
        total = total.to(self.accelerator.device)
        if self._averaging:
            total = self.accelerator.gather(total.reshape(1)).sum()
        return total

    def _count_tokens(self, inputs: Mapping[str, Any], mode: str) -> None:
        name = getattr(unwrap_model(self.trainer.model), "main_input_name", "input_ids")
        if mode == "non_padding" and "attention_mask" in inputs:
            self._tokens += inputs["attention_mask"].sum().to(self._tokens.device)
        elif name in inputs:
            self._tokens += inputs[name].numel()

    def _optimizer_step(self, model) -> None:
        trainer, args, acc = self.trainer, self.args, self.accelerator
        handler, state = trainer.callback_handler, trainer.state
        if args.max_grad_norm > 0:
            if self._clip_plain:
                self.grad_norm = torch.nn.utils.clip_grad_norm_(self._params, args.max_grad_norm)
            else:  # unscales fp16 gradients first / uses the sharded engine's clipping
                self.grad_norm = acc.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        guard = self.guard
        # On a device a bad step's update becomes a no-op there; on the CPU it is left out.
        leave_out = guard is not None and guard.before_step(self.grad_norm)
        trainer.control = handler.on_pre_optimizer_step(args, state, trainer.control)
        if not leave_out:
            trainer.optimizer.step()
        if guard is not None:
            guard.after_step()
        trainer.control = handler.on_optimizer_step(args, state, trainer.control)
        self.learning_rate = trainer._get_learning_rate()
        if (self._clip_plain or not acc.optimizer_step_was_skipped) and steps_per_update(trainer.lr_scheduler):
            trainer.lr_scheduler.step()  # only a loss scaler skips steps; a plateau schedule steps on evaluations
        trainer.optimizer.zero_grad(set_to_none=True)
        if args.torch_empty_cache_steps and (state.global_step + 1) % args.torch_empty_cache_steps == 0:
            _empty_cache(acc.device)

    def _guard_point(self) -> None:
        """After a step or epoch end: at points that synchronize anyway (a log, save or
        evaluation is due, the run stops or ends) or when enough steps are pending, read the
        guard's flags, record the interventions, and pause or stop if they ask for it."""
        trainer, guard, state = self.trainer, self.guard, self.trainer.state
        control = trainer.control
        # A snapshot boundary is a read point too (the snapshot syncs anyway): no snapshot is
        # taken with an unread bad step before it, so rollback always finds the one to use.
        snapshot_due = self.snapshots is not None and self.snapshots.due(state.global_step)
        # An evaluation is a read point too: a new best metric can ask for a save after it.
        if not (control.should_log or control.should_save or control.should_evaluate
                or control.should_training_stop or guard.due()
                or state.global_step >= state.max_steps or snapshot_due or self._rollback_due):
            return
        self.collect_guard(act=True)
        # max_interventions acts once, when an intervention reaches it; a guard getting nowhere
        # (max_no_progress) escalates the same way, saying why.
        stuck = guard.no_progress() if guard.new else None
        if stuck is not None:
            trainer.workbench_state.guard = guard.export()  # the checkpoint says why
            log.warning("guard: no progress: %s; %s", stuck, "pausing" if trainer.guard_pause is not None
                        else "stopping with a checkpoint")
            if self.accelerator.is_main_process:
                EventLog(self.args.output_dir).write("guard_escalated", state.global_step, reason=stuck)
        pause = (any(r["action"] == "pause" for r in guard.new) or (bool(guard.new) and guard.limit_reached())
                 or stuck is not None)
        stop = any(r["action"] == "stop" for r in guard.new)
        if pause and not stop and trainer.guard_pause is not None:
            trainer.guard_pause()  # interactive: the Session pauses before the next step
        elif pause or stop:
            # Headless (or the stop action): stop here with a checkpoint of this boundary,
            # whose weights the guard kept clean. The stop says who asked (the end record,
            # the clients and the CLI tell a guard stop from a finished run); every rank
            # decides it alike from the agreed flags.
            control.should_save = True
            control.should_training_stop = True
            if not trainer.stop_decision.is_set():
                trainer.stop_decision.set("guard", save=True)

    def collect_guard(self, act: bool = False) -> None:
        """Read the guard's pending flags (a host sync) and record new interventions:
        ``guard`` events (main process) and ``workbench_state.guard`` (the next checkpoint).

        ``act``: at the loop's guard point, where a rollback can be carried out; elsewhere
        (a save's own read) a rollback found is left for the next guard point.
        """
        guard, trainer, acc = self.guard, self.trainer, self.accelerator
        guard.new = guard.collect(acc.process_index)
        self._rollback_due.extend(r for r in guard.new if r["action"] == "rollback")
        if act and self._rollback_due:
            self._roll_back(self._rollback_due[0])  # the earliest bad step: later ones are undone with it
            self._rollback_due = []
        if guard.new and acc.is_main_process:
            events = EventLog(self.args.output_dir)
            now = time.time()
            for record in guard.new:
                write, summary = guard.events.admit(record, now)
                if summary is not None:
                    events.write("guard_summary", record["step"], **summary)
                if write:
                    events.write("guard", record["step"], **{k: v for k, v in record.items() if k != "step"})
        trainer.workbench_state.guard = guard.export()

    def _roll_back(self, record: dict[str, Any]) -> None:
        """Carry out a rollback (train/rollback.py) and make this boundary the restored one:
        the loss window restarts, and the log/save/evaluate/stop flags set for the undone
        step are dropped (the end of the run moved back too)."""
        from workbench.train.rollback import roll_back

        trainer, state = self.trainer, self.trainer.state
        at_end = state.global_step >= state.max_steps
        resume = roll_back(trainer, self.guard, self.snapshots, record, self._batches_per_epoch)
        if resume is None:
            return
        self._restart = resume
        self.guard.rolled_back_to(state.global_step)
        # The unlogged losses are partly of undone steps: dropped, counted from the restored step.
        self.window.reset()
        self.last_logged = state.global_step
        control = trainer.control
        control.should_log = control.should_save = control.should_evaluate = False
        control.should_epoch_stop = False
        if at_end:
            control.should_training_stop = False  # set for reaching max_steps, no longer true

    def snapshot_for_save(self) -> None:
        """A save is about to write this boundary (called after its guard read): keep it in
        the rollback ring too, with exactly the state the checkpoint captures. A run resumed
        from that checkpoint has an empty ring and rolls back to the checkpoint itself; the
        uninterrupted run must roll back to the same boundary, or the resume is not bitwise
        equal to it (save_steps and snapshot_every need not line up)."""
        if self.snapshots is None or self._rollback_due:  # a rollback still to come undoes this state
            return
        if self.snapshots.due(self.trainer.state.global_step, saving=True):
            self._take_snapshot()

    def _take_snapshot(self) -> None:
        """A host copy of this boundary into the rollback ring (blocks for the copy only)."""
        from workbench.checkpoint.snapshots import Snapshot

        self.snapshots.add(Snapshot.take(self.trainer, self.guard.position, self.guard.detector()))

    def _log_save_evaluate(self, model, ignore_keys: list[str] | None, start_time: float) -> None:
        """A step or epoch end: hand over to the Trainer's ``_maybe_log_save_evaluate`` (HF's
        override point), with this run's loss window as ``tr_loss``."""
        trainer = self.trainer
        trainer._maybe_log_save_evaluate(self.window, self.grad_norm, model, None, trainer.state.epoch, ignore_keys,
                                         start_time, learning_rate=self.learning_rate)

    def log_loss(self, start_time: float, learning_rate: float | None = None) -> None:
        """Log the loss since the last log (a host sync: a logging point), with grad norm and
        the learning rate the last step used (``learning_rate``; else the current one)."""
        trainer, acc, state = self.trainer, self.accelerator, self.trainer.state
        if state.global_step <= self.last_logged:
            return
        # The mean over ranks (Accelerate's gather is the tensor itself with one process).
        loss_scalar = acc.gather(self.window.total().reshape(1)).mean().item()  # host sync: logging point
        self.window.reset()
        logs: dict[str, float] = {"loss": loss_scalar / (state.global_step - self.last_logged)}
        if self.grad_norm is not None:
            logs["grad_norm"] = float(self.grad_norm)
        logs["learning_rate"] = learning_rate if learning_rate is not None else trainer._get_learning_rate()
        self.total_loss += loss_scalar
        self.last_logged = state.global_step
        self._sync_tokens()
        trainer.store_flos()
        trainer.log(logs, start_time)

    def export_window(self) -> dict[str, Any]:
        """The loss not logged yet, for a checkpoint. One process keeps the entries themselves
        (a resumed run reduces exactly the same values); with several (a collective: every
        rank saves) the ranks' sums are averaged as at a logging point, and every rank carries
        that mean, so the next log's mean over ranks comes out the same."""
        acc = self.accelerator
        if acc.num_processes == 1:
            saved = self.window.export()
        else:
            mean = float(acc.gather(self.window.total().reshape(1)).mean())
            saved = {"folded": mean, "losses": [], "steps": [], "dtype": "float32"}
        return {**saved, "since_step": self.last_logged}

    def _restore_window(self, saved: dict[str, Any] | None) -> None:
        """Continue the window a checkpoint carried; train_loss stays over this run's steps (HF)."""
        state = self.trainer.state
        if not saved or saved.get("since_step") is None or not 0 <= saved["since_step"] <= state.global_step:
            return
        self.window.restore(saved)
        self.last_logged = int(saved["since_step"])
        # The first log after the resume adds the carried loss to total_loss: start below zero.
        self.total_loss = -float(self.accelerator.gather(self.window.total().reshape(1)).mean())

    def _sync_tokens(self) -> None:
        if self.args.include_num_input_tokens_seen == "no":
            return
        tokens = self.accelerator.gather(self._tokens.reshape(1)).sum()  # over ranks; itself with one
        self.trainer.state.num_input_tokens_seen += int(tokens)
        self._tokens.zero_()

    def _finish(self, start_time: float, start_step: int) -> TrainOutput:
        trainer, args = self.trainer, self.args
        state = trainer.state
        trainer._training_loop = None
        summary = self.guard.events.summary() if self.guard is not None else None
        if summary is not None and self.accelerator.is_main_process:
            EventLog(args.output_dir).write("guard_summary", state.global_step, **summary)
        # Fold in loss not yet logged, so train_loss covers every step.
        steps_run = max(state.global_step - start_step, 1)
        remaining = self.window.total().item() if state.global_step > self.last_logged else 0.0
        self.total_loss += remaining
        self._sync_tokens()
        train_loss = self.total_loss / steps_run
        done = state.global_step - start_step
        samples = done * trainer._train_batch_size * args.gradient_accumulation_steps * self.accelerator.num_processes
        metrics = speed_metrics("train", start_time, num_samples=samples, num_steps=done)
        trainer.store_flos()
        metrics["total_flos"] = float(state.total_flos)
        metrics["train_loss"] = train_loss
        metrics.update(trainer._init_memory_metrics)
        metrics.update(trainer._memory_stage("train", start=False))
        trainer.checkpoint_writer.wait()  # background saves are published before the run reports done
        if args.load_best_model_at_end and state.best_model_checkpoint is not None:
            from workbench.checkpoint.trainer_state import load_best_model

            load_best_model(trainer)
        trainer.log(metrics)  # as HF: the returned metrics carry the epoch too
        trainer.control = trainer.callback_handler.on_train_end(args, state, trainer.control)
        return TrainOutput(state.global_step, train_loss, metrics)


def _track_collation(loader: Any, accumulation: int) -> CollationRng | None:
    """Remember the random streams each batch is collated from, where collation may draw from
    them in this process (rng.CollationRng says why a checkpoint needs them)."""
    collate = getattr(loader, "collate_fn", None)
    if isinstance(collate, CollationRng):
        collate.restart()
        return collate
    if collate is None or getattr(loader, "num_workers", 0) > 0 or not draws_random(collate):
        return None
    # At most a step's micro-batches plus the one collated ahead wait untrained.
    tracked = CollationRng(collate, keep=accumulation + 1)
    # Accelerate's loaders read the collator of the DataLoader they wrap (and copy it into
    # the loader skip_first_batches builds).
    getattr(loader, "base_dataloader", loader).collate_fn = tracked
    return tracked


def _empty_cache(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    empty = getattr(backend, "empty_cache", None)
    if callable(empty):
        empty()
