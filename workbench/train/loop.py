"""The training loop of one ``Trainer.train()`` call, read top-down: ``run`` sets up, begins,
goes through the epochs (``_epoch``) and their steps (``_step``) until ``done`` says why
it stops, and finishes.

A step on one screen (``_step``): the callbacks' ``on_step_begin``; the steering gates,
**where a run may wait** (a pause holds the loop there, core/run.py); forward and backward
of each micro-batch; the optimizer step (the guard may leave it out); the position
advanced; the callbacks' ``on_step_end``; the gates again (commands, the ranks' agreement
and a stop become flags); the guard's read point (a rollback restarts the data); then log,
evaluate and save through the Trainer's override point. Everything a step does lives on the
device: the running loss and gradient norm are read back only at logging points
(``.item()`` is a host sync; one per log, none per step). Callbacks observe and set
``TrainerControl`` flags, exactly as in HF; gates steer.
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

import workbench.models.losses as losses
from workbench.checkpoint.lock import check_writable
from workbench.core.run import LoopPosition, Run
from workbench.core.state import WorkbenchState
from workbench.core.trainer_utils import TrainOutput, has_length, speed_metrics, unwrap_model
from workbench.data.samplers import draw_iterator_seed, start_loader_epoch, track_collation
from workbench.distributed.health import monitor_for
from workbench.guard.rollback import resume_position
from workbench.guard.runner import make_guard
from workbench.train.accelerator_setup import optimizer_needs_wrapper, prepare_for_training
from workbench.train.loss_window import LossLog
from workbench.train.schedules import steps_per_update
from workbench.train.memory import memory_at_save
from workbench.train.oom import OomRecovery, batch_rows, free_memory, oom_flags, split_batch
from workbench.train.throughput import device_peak_tflops

__all__ = ["TrainingLoop", "batch_size", "next_micro_batches"]

log = logging.getLogger("workbench")


class TrainingLoop:
    """One call of ``Trainer.train``: set up, run the epochs, finish."""

    def __init__(self, trainer: Run) -> None:
        self.trainer = trainer
        self.args = trainer.args
        self.accelerator = trainer.accelerator

    # -- the run, top-down --------------------------------------------------------------------

    def run(self, checkpoint: Path | None, ignore_keys: list[str] | None) -> TrainOutput:
        """Train from the start, or from ``checkpoint`` (a folder the store resolved and verified)."""
        self.ignore_keys = ignore_keys
        self.ledger = ledger = self.trainer.ledger
        ledger.enter("startup")  # set-up is start-up, as the time since the Trainer was made
        monitor = self.trainer.health_monitor = monitor_for(self.trainer)
        monitor.start()
        try:
            self._setup(checkpoint)
            self._begin()
            while self.done is None:
                epoch, skip = self._next
                self._next = (epoch + 1, 0)
                self._epoch(epoch, skip)
                if self._restart is not None:  # a rollback: the data carries on from its position
                    self._next, self._restart = self._restart, None
            return self._finish()
        finally:
            monitor.stop()
            ledger.enter("other")

    @property
    def done(self) -> str | None:
        """Why the run stops now, or None while it goes on: a stop asked for (a callback's
        flag, a gate's: a signal, a front-end, the guard), or every planned epoch trained
        (max_steps itself sets the stop flag, through DefaultFlowCallback)."""
        if self.trainer.control.should_training_stop:
            return "stopped"
        if self._next[0] >= self._epochs_planned():
            return "epochs done"
        return None

    # -- set-up -------------------------------------------------------------------------------

    def _setup(self, checkpoint: Path | None) -> None:
        """Plan the run from the arguments and the data; make the optimizer, wrap the model;
        a fresh state, or the checkpoint's; the guard and the loss log."""
        trainer, args, acc = self.trainer, self.args, self.accelerator
        from workbench.checkpoint.store import CheckpointStore
        from workbench.checkpoint.trainer_state import load_training_state
        from workbench.core.edits import replay_edits
        from workbench.train.resume_args import apply_changed_arguments

        store = CheckpointStore(args.output_dir)
        if acc.is_main_process:
            check_writable(store.root)
        self.loader = loader = trainer.get_train_dataloader()
        self.batches_per_epoch = len(loader) if has_length(loader) else None
        self.collation = track_collation(loader, args.gradient_accumulation_steps)
        self._trained = 0  # batches of the current iterator that training has taken
        max_steps, self.num_epochs, trainer.updates_per_epoch = self._plan()
        trainer.create_optimizer_and_scheduler(max_steps)
        self.model = prepare_for_training(trainer)
        self._clip_plain = not optimizer_needs_wrapper(acc)
        self._averaging = args.average_tokens_across_devices and acc.num_processes > 1
        self._several = acc.num_processes > 1
        self._mean_is_enough = not self._averaging and trainer.compute_loss_func is None  # see _count_items
        # No loss scaling or engine: training_step can call loss.backward() itself.
        trainer._plain_backward = self._clip_plain
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.guard = make_guard(trainer.guard, trainer, loader, self.batches_per_epoch, self._clip_plain)
        self._restart: tuple[int, int] | None = None  # set by a rollback: where the data resumes
        handler = trainer.callback_handler
        handler.optimizer, handler.lr_scheduler = trainer.optimizer, trainer.lr_scheduler
        handler.train_dataloader, handler.model = loader, trainer.model

        state = trainer.state.__class__(is_local_process_zero=trainer.is_local_process_zero(),
                                        is_world_process_zero=trainer.is_world_process_zero())
        state.train_batch_size = trainer._train_batch_size
        state.compute_steps(args, max_steps)
        state.max_steps = max_steps
        state.num_train_epochs = self.num_epochs if self.num_epochs != sys.maxsize else 0
        trainer.state = state
        trainer.workbench_state = WorkbenchState()
        trainer.position = LoopPosition()
        trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        self._replay: list[dict[str, Any]] = []
        if checkpoint is not None:
            self._replay = load_training_state(trainer, checkpoint)
            trainer.state.max_steps = max_steps
            replay_edits(trainer)  # a live max_steps edit outlives the restart
            trainer.position = self._resumed_position()
            # This launch's arguments where they differ from the checkpoint's: warned about,
            # and the live-editable ones applied from here as a recorded edit (resume_args.py).
            apply_changed_arguments(trainer, checkpoint, max_steps)
        if acc.is_main_process:
            store.clean_temporaries()
        self.losses = LossLog(trainer)
        self.oom = OomRecovery(trainer.health.oom_retries)
        self._piece = 0
        self._oom_flags = oom_flags(self.model, acc, trainer.health.oom_retries)
        self.oom.restore(trainer.workbench_state.live_edits)  # a resumed run cuts its batches as it did
        trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps * self.oom.split
        if checkpoint is not None:  # forecast once the cut is back: the pieces, not the whole batch, must fit
            problem = self.oom.forecast(trainer.workbench_state.memory, args.per_device_train_batch_size)
            if problem is not None:  # before a step runs out of memory (on devices that count it)
                raise ValueError(f"resuming from {checkpoint.name}: {problem}")
            self.losses.restore(trainer.workbench_state.loss_window)
        peak = device_peak_tflops(acc.device, acc.mixed_precision, trainer.health.peak_tflops)
        trainer.throughput.start(acc.device, peak)
        self._idle_at = 0.0  # evaluation, save and paused seconds at the last throughput window
        # The Trainer's step-end hooks and every save (wherever asked for) reach this run through it.
        trainer.loop = self
        trainer.current_flos = 0
        self._tokens = torch.zeros((), dtype=torch.long, device=acc.device)

    def _plan(self) -> tuple[int, int, int | None]:
        """(max_steps, num_epochs, updates_per_epoch) from the arguments and the data."""
        args = self.args
        ga = args.gradient_accumulation_steps
        if self.batches_per_epoch is not None:
            updates_per_epoch = max(math.ceil(self.batches_per_epoch / ga), 1)
            if args.max_steps > 0:
                return args.max_steps, math.ceil(args.max_steps / updates_per_epoch), updates_per_epoch
            max_steps = math.ceil(args.num_train_epochs * updates_per_epoch)
            return max_steps, math.ceil(args.num_train_epochs), updates_per_epoch
        if args.max_steps <= 0:
            raise ValueError("max_steps: the train dataset has no length (an IterableDataset), so set max_steps")
        return args.max_steps, sys.maxsize, None

    def _resumed_position(self) -> LoopPosition:
        """Where a resumed run's data goes on: the position its checkpoint saved, when it was
        taken with the same batches an epoch (same batch size, processes and drop_last); else,
        as HF, the one its step implies (finished epochs are never repeated). With
        ``ignore_data_skip`` the current epoch restarts at its first batch."""
        trainer = self.trainer
        saved = trainer.workbench_state
        position = resume_position(saved, trainer.state.global_step, trainer.updates_per_epoch,
                                   self.args.gradient_accumulation_steps)
        if (saved.position or {}).get("epoch_batches", self.batches_per_epoch) != self.batches_per_epoch:
            position = resume_position(None, trainer.state.global_step, trainer.updates_per_epoch,
                                       self.args.gradient_accumulation_steps)
        position.epoch, position.batch = position.normalized(self.batches_per_epoch)
        if self.args.ignore_data_skip:
            position.batch = 0
        return position

    def _begin(self) -> None:
        """The run begins: the callbacks and gates hear it, an evaluation on start, the guard
        (a resumed one decides as the uninterrupted run did)."""
        trainer, args, state = self.trainer, self.args, self.trainer.state
        trainer._memory_stage("train", start=True)
        self.start_time = time.perf_counter()
        self.start_step = self.ledger.step = state.global_step
        trainer.control = trainer.callback_handler.on_train_begin(args, state, trainer.control)
        trainer.gates.train_begin(trainer)
        if state.global_step >= state.max_steps:
            trainer.control.should_training_stop = True  # resumed from the last step: nothing left to train
        if args.eval_on_start and state.global_step == 0:
            trainer._evaluate(None, self.ignore_keys, skip_scheduler=True)
            if trainer.control.should_save:  # a stop was requested during that evaluation
                self._log_save_evaluate()
        self.guard.start(trainer)
        # (epoch, micro-batches to skip in it) where the data goes on: the next epoch to enter.
        self._next = (trainer.position.epoch, trainer.position.batch)

    def _epochs_planned(self) -> int:
        """Epochs the loop may enter: enough for max_steps, plus the data rollbacks skipped
        (an overestimate is harmless: the run stops at max_steps). Re-planned each epoch: a
        live max_steps / num_train_epochs edit (or its replay on resume) can need more epochs
        than the arguments planned."""
        per_epoch = self.trainer.updates_per_epoch
        if not per_epoch:
            return self.num_epochs
        planned = math.ceil(self.trainer.state.max_steps / per_epoch)
        skipped = self.trainer.position.skipped
        if skipped and self.batches_per_epoch:
            planned += math.ceil(skipped / self.batches_per_epoch) + 1
        return planned

    # -- an epoch, its steps --------------------------------------------------------------------

    def _epoch(self, epoch: int, skip: int) -> None:
        """Train epoch ``epoch`` from its micro-batch ``skip`` until it ends or the run stops."""
        trainer, args = self.trainer, self.args
        handler, loader = trainer.callback_handler, self.loader
        position = trainer.position
        position.epoch, position.batch = epoch, skip
        # Samplers, collator and generator are found through the loader itself, so a
        # get_train_dataloader override is seeded per epoch like the built-in loader.
        start_loader_epoch(loader, epoch, args.data_seed if args.data_seed is not None else args.seed)
        source = loader
        if skip:
            from accelerate import skip_first_batches

            source = skip_first_batches(loader, skip)
        else:
            draw_iterator_seed(loader, epoch)  # HF's loader draws this as the epoch starts
        trainer.control = handler.on_epoch_begin(args, trainer.state, trainer.control)
        if self.collation is not None:
            self.collation.restart()
            if self._replay:  # the batches the checkpoint's run had collated, drawn as it drew them
                self.collation.replay(self._replay)
                self._replay = []
        self._trained = 0
        iterator = iter(source)
        while not trainer.control.should_training_stop:
            self.ledger.enter("data")
            micro = next_micro_batches(iterator, args.gradient_accumulation_steps)
            if not micro or not self._step(micro):
                break
            if self._restart is not None:
                return  # rolled back: this epoch's iterator is stale; run() restarts the data
            if trainer.control.should_epoch_stop or trainer.control.should_training_stop:
                break
        self.ledger.enter("other")
        trainer.control = handler.on_epoch_end(args, trainer.state, trainer.control)
        # An epoch-end save or evaluation reads the guard first, as a step end does: a
        # checkpoint must never hold a rollback still to be carried out.
        if self._read_guard() and not trainer.control.should_training_stop:
            return  # rolled back: the data restarts where the rollback says (run())
        self._log_save_evaluate()

    def _step(self, micro: list[Any]) -> bool:
        """One optimizer step over the micro-batches ``micro``; False when the run stopped
        before the step trained. After a rollback ``_restart`` says where the data goes on."""
        trainer, args, state = self.trainer, self.args, self.trainer.state
        handler, guard, position = trainer.callback_handler, self.guard, trainer.position
        num_items = self._count_items(micro)
        trainer.last_inputs = micro[-1]  # for inspection while paused (a reference, no copy)
        trainer.control = handler.on_step_begin(args, state, trainer.control)
        ledger = self.ledger
        ledger.enter("paused")  # only while a pause holds the loop does this take any time
        trainer.gates.step_start(trainer)  # a run may wait here: a pause holds the loop at this boundary
        ledger.enter("forward")
        computed = ledger.compute()
        if trainer.control.should_training_stop:
            # Stopped before this step ran (e.g. while paused at its start): save the
            # state of the boundary if asked, and leave the fetched batches untouched.
            self._log_save_evaluate()
            return False
        if self._restart is not None:  # a fork's variant was kept while paused here (session/fork_commands.py):
            return True  # the run is at that variant's end, and the data goes on from there (_epoch returns)
        first = position.batch
        pieces, step_losses = self._forward_backward(micro, num_items)
        if pieces is None:  # out of memory past what can be recovered: stop, saving this boundary
            self._log_save_evaluate()
            return False
        self._trained += len(micro)
        for inputs, loss in zip(pieces, step_losses):
            if args.include_num_input_tokens_seen != "no":
                self._count_tokens(inputs, args.include_num_input_tokens_seen)
            flos = float(trainer.floating_point_ops(inputs))  # HF: per micro-batch
            trainer.current_flos += flos
            self.losses.add(loss)
            guard.add_loss(loss)
            samples = batch_size(inputs)
            position.samples += samples
            trainer.throughput.add(inputs, samples, flos)
        ledger.enter("optimizer")
        self._optimizer_step()
        ledger.enter("other")
        state.global_step += 1
        ledger.step_done(state.global_step, ledger.compute() - computed)
        position.batch += len(micro)
        position.update = state.global_step
        state.epoch = position.epoch + (position.batch / self.batches_per_epoch if self.batches_per_epoch
                                        else state.global_step / state.max_steps)
        guard.end_step(trainer, position.epoch, first, position.batch - 1)
        trainer.control = handler.on_step_end(args, state, trainer.control)
        if self._several:
            ledger.enter("collective")  # the ranks' agreement is collected here
        trainer.gates.step_end(trainer)
        ledger.enter("other")
        self._read_guard()
        if self._restart is None or trainer.control.should_training_stop:
            self._log_save_evaluate()  # (a rollback that also stops saves the restored boundary)
        return True

    def _read_guard(self) -> bool:
        """The guard's read point (a step or epoch end); True when it rolled back. ``_restart``
        then says where the data goes on, and what the undone steps left is dropped alike on
        both paths: their unlogged losses, and their compute time (booked as rolled back)."""
        self._restart = self.guard.read_point(self.trainer)
        if self._restart is None:
            return False
        step = self.trainer.state.global_step  # the restored boundary
        self.losses.restart_at(step)
        self.ledger.undo_steps(step)
        return True

    def _forward_backward(self, micro: list[Any], num_items: Any) -> tuple[list[Any] | None, list[Any]]:
        """Forward and backward of a step's micro-batches (each cut in parts after an out-of-
        memory error on this rank or, with several ranks, on any: train/oom.py): (the pieces
        trained, their losses), or (None, []) when memory ran out past what can be recovered
        (the run then stops with a checkpoint)."""
        trainer = self.trainer
        while True:
            pieces = self.oom.pieces(micro)
            if len(pieces) != len(micro):
                num_items = self._count_items(pieces)
            failed = None  # where this rank ran out of memory: (piece, phase)
            try:
                out = self._backward_all(pieces, num_items)
            except torch.OutOfMemoryError:
                failed = (self._piece, self.ledger.phase)
            if failed is not None:
                where = f"{failed[1]} on rank {trainer.accelerator.process_index}" if self._several else failed[1]
                if self._several:
                    self._join_step(pieces, num_items, *failed)
            elif self._oom_flags is not None:
                flag = self._oom_flags.read(trainer.state.global_step, self.oom.recovered)
                if flag is None:
                    return pieces, out
                where = f"{flag['phase']} on rank {flag['rank']}"
            else:
                return pieces, out
            why = self.oom.recover(trainer, micro, where)
            if why is not None:
                self.oom.give_up(trainer, why)  # stops with a checkpoint of this boundary
                return None, []

    def _join_step(self, pieces: list[Any], num_items: Any, failed_at: int, phase: str) -> None:
        """This rank ran out of memory in piece ``failed_at`` of a step that other ranks go on
        training: flag it, then run one-row passes of the pieces left, so this rank's
        collectives match theirs (distributed/oom_flags.py), and the step is redone by all."""
        trainer, last = self.trainer, len(pieces) - 1
        if self._oom_flags is None or (failed_at == last and phase == "backward"):
            if self._oom_flags is not None:
                where = "the gradients' all-reduce had begun"
            elif self.oom.retries == 0:
                where = "oom_retries = 0"
            elif trainer.accelerator.device.type == "cpu":
                where = "no agreement between the ranks on CPU devices; WORKBENCH_OOM_AGREEMENT=1 turns it on"
            else:
                where = "FSDP and DeepSpeed hold collectives in the forward"
            raise torch.OutOfMemoryError(
                f"out of memory in {phase} on rank {trainer.accelerator.process_index} at step "
                f"{trainer.state.global_step + 1}, not recoverable in place ({where}); resume from the last "
                "checkpoint with a smaller per_device_train_batch_size")
        self._oom_flags.raise_flag(trainer.state.global_step, self.oom.recovered, phase)
        free_memory(trainer)
        # DDP broadcasts the buffers at a step's first forward and then clears this flag, which
        # the failed forward never got to: cleared here, the passes below broadcast as the other
        # ranks' forwards of the same pieces do (not at all).
        self.model.require_forward_param_sync = False
        # A failed last piece is passed again (its all-reduce is still to come), others from the next.
        for i in range(min(failed_at + 1, last), last + 1):
            row = split_batch(pieces[i], max(batch_rows(pieces[i]), 1))[0]
            with contextlib.nullcontext() if i == last else self.accelerator.no_sync(self.model):
                trainer.training_step(self.model, row, num_items)

    def _backward_all(self, pieces: list[Any], num_items: Any) -> list[Any]:
        trainer, last = self.trainer, len(pieces) - 1
        out = []
        for i, inputs in enumerate(pieces):
            self._piece = i  # where an out-of-memory error struck
            self.ledger.enter("forward")  # training_step switches to backward itself
            # Accumulating micro-batches skip the gradients' all-reduce (a no-op with one process).
            with contextlib.nullcontext() if i == last else self.accelerator.no_sync(self.model):
                out.append(trainer.training_step(self.model, inputs, num_items))
            if i != last:
                trainer.control = trainer.callback_handler.on_substep_end(self.args, trainer.state, trainer.control)
        return out

    def _optimizer_step(self) -> None:
        trainer, args, acc = self.trainer, self.args, self.accelerator
        handler, state = trainer.callback_handler, trainer.state
        if args.max_grad_norm > 0:
            if self._clip_plain:
                self.losses.grad_norm = torch.nn.utils.clip_grad_norm_(self._params, args.max_grad_norm)
            else:  # unscales fp16 gradients first / uses the sharded engine's clipping
                self.losses.grad_norm = acc.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
        # On a device a bad step's update becomes a no-op there; on the CPU it is left out.
        leave_out = self.guard.before_step(self.losses.grad_norm)
        trainer.gates.after_backward(trainer)
        trainer.control = handler.on_pre_optimizer_step(args, state, trainer.control)
        if not leave_out:
            trainer.optimizer.step()
        self.guard.after_step()
        trainer.control = handler.on_optimizer_step(args, state, trainer.control)
        self.losses.learning_rate = trainer._get_learning_rate()
        if (self._clip_plain or not acc.optimizer_step_was_skipped) and steps_per_update(trainer.lr_scheduler):
            trainer.lr_scheduler.step()  # only a loss scaler skips steps; a plateau schedule steps on evaluations
        trainer.optimizer.zero_grad(set_to_none=True)
        if args.torch_empty_cache_steps and (state.global_step + 1) % args.torch_empty_cache_steps == 0:
            _empty_cache(acc.device)

    def _log_save_evaluate(self) -> None:
        """A step or epoch end: hand over to the Trainer's ``_maybe_log_save_evaluate`` (HF's
        override point), with this run's loss window as ``tr_loss``."""
        trainer = self.trainer
        trainer._maybe_log_save_evaluate(self.losses.window, self.losses.grad_norm, self.model, None,
                                         trainer.state.epoch, self.ignore_keys, self.start_time,
                                         learning_rate=self.losses.learning_rate)

    # -- what the Trainer and a save ask of the loop (core/run.py LoopHooks) -------------------

    def log_loss(self, start_time: float, learning_rate: float | None = None) -> None:
        """Log the loss since the last log (a logging point). With several ranks the loss, the
        tokens and the FLOP are summed over them: the ledger books that as collective."""
        left = self.ledger.enter("collective") if self._several else None
        logs = self.losses.log(start_time, learning_rate)
        if logs is not None:
            self._sync_tokens()
            self.trainer.store_flos()
        if left is not None:
            self.ledger.enter(left)
        if logs is None:
            return
        summary = self.ledger.summary()
        idle = summary["evaluation"] + summary["save"] + summary["paused"]
        self.trainer.throughput.window(exclude_seconds=idle - self._idle_at)  # rates of the training time
        self._idle_at = idle
        self.trainer.log(logs, start_time)

    def prepare_save(self) -> None:
        """A checkpoint of this boundary is being written: the unlogged loss, the guard's
        records (and its rollback point of this boundary) and the position go into it."""
        trainer = self.trainer
        # Tokens are summed over ranks at logs only (no per-step sync); a checkpoint between
        # two logs must still hold every step's (HF counts each step). Every rank saves, as
        # store_flos's sum just before this needs.
        self._sync_tokens()
        trainer.workbench_state.loss_window = self.losses.export()
        self.guard.prepare_save(trainer)
        trainer.workbench_state.position = {**trainer.position.export(), "epoch_batches": self.batches_per_epoch}
        rows = self.oom.rows(self.args.per_device_train_batch_size)  # the pieces a step trains now
        trainer.workbench_state.memory = memory_at_save(unwrap_model(trainer.model), trainer.optimizer,
                                                        self.accelerator.device, rows)

    def pending_batches(self) -> list[dict[str, Any]]:
        """The host random streams of batches collated but not trained yet (core/rng.py's
        CollationRng), for a checkpoint written at this boundary."""
        return self.collation.pending(self._trained) if self.collation is not None else []

    # -- counting -----------------------------------------------------------------------------

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
            left = self.ledger.enter("collective")  # the ranks wait for each other here
            total = self.accelerator.gather(total.reshape(1)).sum()
            self.ledger.enter(left)
        return total

    def _count_tokens(self, inputs: Mapping[str, Any], mode: str) -> None:
        name = getattr(unwrap_model(self.trainer.model), "main_input_name", "input_ids")
        if mode == "non_padding" and "attention_mask" in inputs:
            self._tokens += inputs["attention_mask"].sum().to(self._tokens.device)
        elif name in inputs:
            self._tokens += inputs[name].numel()

    def _sync_tokens(self) -> None:
        if self.args.include_num_input_tokens_seen == "no":
            return
        tokens = self.accelerator.gather(self._tokens.reshape(1)).sum()  # over ranks; itself with one
        self.trainer.state.num_input_tokens_seen += int(tokens)
        self._tokens.zero_()

    def _gather_ledgers(self) -> None:
        # Where each rank's time went, exactly, for the end record: one small gather where every
        # rank ends (as the tokens' sum above), not the heartbeats' view, up to seconds old.
        if self.accelerator.num_processes < 2:
            return
        own = self.ledger.summary()
        keys = sorted(own)
        row = torch.tensor([[own[k] for k in keys]], dtype=torch.float64, device=self.accelerator.device)
        table = self.accelerator.gather(row).tolist()
        self.ledger.by_rank = {str(r): {k: round(v, 4) for k, v in zip(keys, values)} for r, values in enumerate(table)}

    # -- the end ------------------------------------------------------------------------------

    def _finish(self) -> TrainOutput:
        trainer, args = self.trainer, self.args
        state = trainer.state
        trainer.loop = None
        self.guard.finish(trainer)
        done = state.global_step - self.start_step
        train_loss = self.losses.train_loss(done)
        self._sync_tokens()
        self._gather_ledgers()
        samples = done * trainer._train_batch_size * args.gradient_accumulation_steps * self.accelerator.num_processes
        metrics = speed_metrics("train", self.start_time, num_samples=samples, num_steps=done)
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
        trainer.gates.train_end(trainer)
        trainer.control = trainer.callback_handler.on_train_end(args, state, trainer.control)
        return TrainOutput(state.global_step, train_loss, metrics)


def next_micro_batches(iterator: Any, count: int) -> list[Any]:
    """Up to ``count`` batches from ``iterator`` (fewer at the end of an epoch)."""
    micro = []
    for _ in range(count):
        try:
            micro.append(next(iterator))
        except StopIteration:
            break
    return micro


def batch_size(inputs: Any) -> int:
    """The samples in a micro-batch: the first dimension of its first tensor (any Mapping is
    a batch of named inputs; a tensor or a tuple of tensors is positional)."""
    if isinstance(inputs, Mapping):
        inputs = next(iter(inputs.values()), None)
    elif isinstance(inputs, (list, tuple)) and inputs:
        inputs = inputs[0]
    shape = getattr(inputs, "shape", None)
    return int(shape[0]) if shape else 1


def _empty_cache(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    empty = getattr(backend, "empty_cache", None)
    if callable(empty):
        empty()
