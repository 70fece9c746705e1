"""Trainer: the Hugging Face ``Trainer`` surface on Accelerate.

The Trainer is a ``Run`` (core/run.py: the run's state, declared in one place) and the HF
facade over it: its methods are the override points users know (compute_loss,
training_step, prediction_step, evaluate, save_model, ...), and every layer calls them. Its
other override points are mixins, one a module: the data loaders (loaders.py), the
optimizer and schedule (optim.py), the reporting methods (reports.py), the model's facts
and its loss (loss.py). The loop is
loop.py, evaluation evaluation.py, checkpoint files checkpoint/, the Accelerator set-up
accelerator_setup.py, so each piece stays readable.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from workbench.core.args.training import TrainingArguments
from workbench.core.args.hf import as_workbench_arguments
from workbench.guard.settings import Guard
from workbench.core.ledger import Ledger
from workbench.train.throughput import Throughput
from workbench.distributed.health import Health
from workbench.core.callbacks import CallbackHandler, TrainerCallback
from workbench.core.state import TrainerControl, TrainerState, WorkbenchState
from workbench.train.callbacks import DefaultFlowCallback, PrinterCallback, ProgressCallback
from workbench.train.loaders import TrainerData
from workbench.train.loss import TrainerLoss
from workbench.train.reports import TrainerReports
from workbench.data.collators import default_collator_for
from workbench.train.optim import TrainerOptimizer
from workbench.train.schedules import step_on_metric
from workbench.checkpoint.lock import hold_output_dir
from workbench.checkpoint.store import CheckpointStore
from workbench.train.accelerator_setup import check_sharding, make_accelerator
from workbench.train.one_run import check_free as check_process_free, claim as claim_process
from workbench.core.run import Gates, LoopPosition, Run
from workbench.core.stop import StopRequest
from workbench.distributed.rank_sync import RankSync
from workbench.distributed.signals import StopGate, install_stop_handlers
from workbench.core.records import is_timing_metric
from workbench.core.trainer_utils import (
    EvalLoopOutput,
    PredictionOutput,
    TrainOutput,
    set_seed,
    unwrap_model,
)

log = logging.getLogger("workbench")

__all__ = ["Trainer", "DEFAULT_CALLBACKS"]

# What every Trainer starts with, as in HF (progress and trackers come on top; the stop is a gate).
DEFAULT_CALLBACKS = [DefaultFlowCallback]


class Trainer(TrainerData, TrainerOptimizer, TrainerReports, TrainerLoss, Run):
    """Train, evaluate and predict with any ``nn.Module`` (HF-compatible constructor).

    The model's forward may return a dict / ModelOutput / tuple with the loss first. A
    model that returns only logits is trained with the default loss of its kind
    (``model.loss_type`` or the class-name suffix, e.g. "ForCausalLM").
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        processing_class: Any = None,
        model_init: Callable[..., nn.Module] | None = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        guard: Guard | None = None,
        health: Health | None = None,
    ) -> None:
        # Not while another run trains here: the seed and the Accelerator reset below would
        # change its RNG and precision under it (one_run.py).
        check_process_free("build a Trainer")
        # transformers' TrainingArguments are read into workbench's (the user's object untouched).
        self.args = as_workbench_arguments(args) if args is not None else TrainingArguments("tmp_trainer")
        # workbench: what to do about non-finite or spiking losses (workbench/guard/); None is
        # off, as in HF. A guard that asks to pause pauses a run a gate can hold (a Session's),
        # and stops one no one can resume with a checkpoint instead.
        if guard is not None and not isinstance(guard, Guard):
            raise TypeError(f"guard: expected a workbench Guard, got {type(guard).__name__}")
        self.guard: Guard | None = guard
        # workbench: the time ledger (from here: start-up) and how the run watches itself
        # for hangs and stragglers (distributed/health.py); on by default, cheap.
        self.ledger = Ledger()
        self.throughput = Throughput()  # tokens, samples, FLOP per second and MFU at each log
        if health is not None and not isinstance(health, Health):
            raise TypeError(f"health: expected a workbench Health, got {type(health).__name__}")
        self.health = health if health is not None else Health()
        self.health_listeners = []
        self.edit_listeners = []  # core/edits.py record_edit: a Session's snapshot and events hear the run's edits
        # workbench: the Session training this Trainer, if any; it then owns the control
        # endpoint, and train() does not serve one of its own (args.control, workbench/core/serving.py).
        self.control_owner: Any = None
        set_seed(self.args.seed, deterministic=self.args.full_determinism)
        self.accelerator = make_accelerator(self.args)
        check_sharding(self)
        self._host_device = self.accelerator.device.type == "cpu"  # read per step; the property is not free
        self._memory = None
        if not self.args.skip_memory_metrics:
            from workbench.train.memory import StageMemoryTracker

            self._memory = StageMemoryTracker(self.accelerator.device)
            self._memory.start("init")
        self.model_init = model_init
        if model is None:
            if model_init is None:
                raise ValueError("Trainer needs a model or a model_init function")
            model = self.call_model_init()
        elif model_init is not None:
            log.warning("both model and model_init given: model_init replaces the model when train() starts")
        if optimizers[0] is not None and optimizer_cls_and_kwargs is not None:
            raise ValueError("pass either optimizers or optimizer_cls_and_kwargs, not both")
        self.model = model.to(self.accelerator.device)
        self.model_wrapped = self.model
        self.processing_class = processing_class
        # As HF: a tokenizer-like processing class means padding, anything else plain stacking.
        self.data_collator = data_collator or default_collator_for(processing_class)
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.compute_loss_func = compute_loss_func
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        if (self.args.batch_eval_metrics and compute_metrics is not None
                and "compute_result" not in inspect.signature(compute_metrics).parameters):
            raise ValueError("batch_eval_metrics: compute_metrics must take a compute_result argument (True after "
                             "the last batch: return the summary then); add it, or unset batch_eval_metrics")
        if self.args.save_strategy == "best" and self.args.metric_for_best_model is None:
            raise ValueError("`args.metric_for_best_model` must be provided when using 'best' save_strategy or if "
                             "`args.load_best_model_at_end` is set to `True`.")
        if eval_dataset is None and (self.args.eval_strategy != "no" or self.args.eval_on_start):
            setting = "eval_on_start" if self.args.eval_on_start else f"eval_strategy={self.args.eval_strategy!r}"
            raise ValueError(f"{setting} needs an eval_dataset: pass one to Trainer, or set eval_strategy to \"no\"")
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        # A schedule the Trainer built is rebuilt by each train() (and each
        # auto_find_batch_size retry) for that run's step count, as HF does.
        self._created_lr_scheduler = False
        self._train_batch_size = self.args.train_batch_size
        self._eval_dataloaders: dict[str, DataLoader] = {}  # persistent-worker loaders, reused
        # The training loop while it runs (its loss window is HF's tr_loss), else None.
        self.loop = None
        self.position = LoopPosition()

        from workbench.train.tracking import reporting_callbacks

        # Signals, Ctrl-C, the UI and Session.stop() all set this one request; the stop gate
        # turns it into save + stop at the next safe point.
        self.stop_request = StopRequest()
        # What the loop acts on. With one process that is the request itself; with several,
        # the ranks agree on it at step ends first (rank_sync.py), so all stop together.
        self.stop_decision = self.stop_request
        # The steering gates (core/run.py): the ranks' agreement, a front-end's steering (a
        # Session installs it), the stop. Callbacks only observe and set flags, as in HF.
        self.gates = Gates()
        self.gates.set("stop", StopGate())
        self.rank_sync: RankSync | None = None
        if self.accelerator.num_processes > 1:
            self.stop_decision = StopRequest()
            self.rank_sync = RankSync(self)
            self.gates.set("agreement", self.rank_sync)
        from workbench.checkpoint.async_save import CheckpointWriter

        self.checkpoint_writer = CheckpointWriter()  # save_async writes here, in the background
        defaults: list[Any] = [*DEFAULT_CALLBACKS, *reporting_callbacks(self.args, self.stop_decision, self.ledger,
                                                                               self.throughput)]
        # As HF: the bare printer when progress bars are disabled, else the progress lines.
        defaults.append(PrinterCallback if self.args.disable_tqdm else ProgressCallback)
        self.callback_handler = CallbackHandler(
            defaults + list(callbacks or []), self.model, processing_class, self.optimizer, self.lr_scheduler
        )
        self.state = TrainerState(
            is_local_process_zero=self.is_local_process_zero(),
            is_world_process_zero=self.is_world_process_zero(),
        )
        self.workbench_state = WorkbenchState()  # live edits, unlogged loss, guard: workbench_state.json
        self.control = TrainerControl()
        self._inspect_model()
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)
        self._init_memory_metrics = self._memory.stop("init") if self._memory else {}

    def _memory_stage(self, stage: str, start: bool) -> dict[str, int]:
        """Start or stop HF's per-stage memory metrics (skip_memory_metrics=False)."""
        if self._memory is None:
            return {}
        if start:
            self._memory.start(stage)
            return {}
        return self._memory.stop(stage)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """Build a model with ``model_init`` (it may take the trial or nothing)."""
        n_args = len(inspect.signature(self.model_init).parameters)
        model = self.model_init() if n_args == 0 else self.model_init(trial)
        if model is None:
            raise RuntimeError("model_init returned None; it must return an nn.Module")
        return model

    # -- processes -----------------------------------------------------------------------

    def is_world_process_zero(self) -> bool:
        """Whether this is the main process of the whole run."""
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        """Whether this is the main process on this machine."""
        return self.accelerator.is_local_main_process

    # -- callbacks -------------------------------------------------------------------------

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Add a callback (instance or class)."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> TrainerCallback | None:
        """Remove a callback and return it (None if absent)."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Remove a callback (instance or first of a class)."""
        self.callback_handler.remove_callback(callback)

    # -- steps -------------------------------------------------------------------------------

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Move a batch to the training device (nothing to do when that is the CPU)."""
        if self._host_device:
            return inputs  # batches are built on the host; walking them costs µs per step
        from accelerate.utils import send_to_device

        return send_to_device(inputs, self.accelerator.device, non_blocking=True)

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """Forward + backward of one micro-batch; returns the detached loss (scaled as applied)."""
        if not model.training:  # eval() in between; a per-step train() walk costs ~0.1 ms
            model.train()
        inputs = self._prepare_inputs(inputs)
        trainer_loss = self._trainer_computes_loss(inputs, num_items_in_batch)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        normalized = num_items_in_batch is not None and (
            self.compute_loss_func is not None or trainer_loss
            or (self.model_accepts_loss_kwargs and self._model_loss_counts)
        )
        if not normalized and self.current_gradient_accumulation_steps != 1:
            loss = loss / self.current_gradient_accumulation_steps
        if self.loop is not None:
            self.ledger.enter("backward")
        if self._plain_backward:
            loss.backward()
        else:  # loss scaling (fp16) and engines (DeepSpeed) go through Accelerate
            self.accelerator.backward(loss)
        return loss.detach()

    current_gradient_accumulation_steps = 1
    _plain_backward = False  # set by the loop once it knows there is no scaler or engine

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        """One evaluation batch: ``(loss, logits, labels)``, each None when not available."""
        inputs = self._prepare_inputs(inputs)
        has_labels = all(inputs.get(name) is not None for name in self.label_names)
        labels = None
        if has_labels:
            labels = tuple(inputs[name] for name in self.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        if ignore_keys is None:  # as HF: a model's cache is not a prediction (v4 names it past_key_values, v5 cache)
            config = getattr(unwrap_model(model), "config", None)
            ignore_keys = getattr(config, "keys_to_ignore_at_inference", ["past_key_values", "cache"]) if config is not None else []
        ignore = set(ignore_keys) | {"loss"}
        model.eval()
        with torch.no_grad():
            if has_labels or self.compute_loss_func is not None and "labels" in inputs:
                with self.compute_loss_context_manager():
                    loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
                loss = loss.detach().mean()
                if isinstance(outputs, dict):
                    logits = tuple(v for k, v in outputs.items() if k not in ignore)
                else:
                    logits = outputs[1:]
            else:
                loss = None
                with self.compute_loss_context_manager():
                    outputs = model(**inputs)
                logits = tuple(v for k, v in outputs.items() if k not in ignore) if isinstance(outputs, dict) else outputs
        if prediction_loss_only:
            return loss, None, None
        if isinstance(logits, tuple) and len(logits) == 1:
            logits = logits[0]
        return loss, logits, labels

    # -- public entry points -----------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> TrainOutput:
        """Train; ``resume_from_checkpoint`` True resumes from the newest verified checkpoint.

        With ``args.control = True`` (workbench; off by default, as HF) rank 0 serves a control
        endpoint meanwhile, so ``workbench ctl`` / ``workbench attach OUTDIR`` can pause, edit,
        save, evaluate and stop this run; it still trains in this thread and returns TrainOutput."""
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments: {', '.join(kwargs)}")
        if self.args.control and self.control_owner is None and self.is_world_process_zero():
            # workbench: serve the control endpoint (rank 0) while this same call trains;
            # the runner comes from the session layer (workbench/core/serving.py).
            from workbench.core.serving import control_runner

            return control_runner()(self, resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                    ignore_keys_for_eval=ignore_keys_for_eval)
        with claim_process(self):  # one run a process: Accelerate's state is process-wide (one_run.py)
            return self._train(resume_from_checkpoint, trial, ignore_keys_for_eval)

    def _train(self, resume_from_checkpoint: str | bool | None, trial: Any,
               ignore_keys_for_eval: list[str] | None) -> TrainOutput:
        """train()'s body, with the process claimed for this run."""
        from workbench.train.loop import TrainingLoop

        if self.model_init is not None:
            set_seed(self.args.seed)
            self.model = self.call_model_init(trial).to(self.accelerator.device)
            self.model_wrapped = self.model
            self.callback_handler.model = self.model
            self.optimizer, self.lr_scheduler = None, None
            self._inspect_model()

        def inner(batch_size: int) -> TrainOutput:
            self._train_batch_size = batch_size
            if self._created_lr_scheduler:
                self.lr_scheduler, self._created_lr_scheduler = None, False
            return TrainingLoop(self).run(checkpoint, ignore_keys_for_eval)

        # Resolved (and verified) before anything is written: a run with nothing to resume
        # from leaves the output_dir as it was.
        checkpoint = (CheckpointStore(self.args.output_dir).resolve_resume(resume_from_checkpoint)
                      if resume_from_checkpoint else None)
        self.stop_request.clear()
        self.stop_decision.clear()
        restore = None
        if self.args.enable_jit_checkpoint and threading.current_thread() is threading.main_thread():
            restore = install_stop_handlers(self.stop_request, [signal.SIGTERM])
        self.neftune_hook_handle = None
        failed = False
        if self.args.neftune_noise_alpha is not None:
            from workbench.train.neftune import activate_neftune

            # Training only: the hook checks module.training, and is removed when train() ends.
            self.neftune_hook_handle = activate_neftune(self.model, self.args.neftune_noise_alpha)
        if checkpoint is not None and self.args.auto_find_batch_size:
            self._restore_found_batch_size(checkpoint)
        try:
            # One writer per output_dir: rank 0 holds its lock while training (outdir_lock.py).
            with hold_output_dir(self.args.output_dir) if self.is_world_process_zero() else contextlib.nullcontext():
                if self.args.auto_find_batch_size:
                    from accelerate.utils import find_executable_batch_size

                    return find_executable_batch_size(inner, starting_batch_size=self._train_batch_size)()
                return inner(self._train_batch_size)
        except BaseException as exc:
            failed = True
            try:
                self.callback_handler.on_error(self.args, self.state, self.control, exc)
            except Exception as hook_exc:  # e.g. the event log cannot be written either
                from workbench.checkpoint.storage_errors import same_storage_failure

                if not same_storage_failure(exc, hook_exc):  # a full disk is said once, by the error itself
                    log.warning("an on_error callback failed (%s: %s); raising the original error",
                                type(hook_exc).__name__, hook_exc)
            raise
        finally:
            try:
                self.checkpoint_writer.wait()  # a save still being written is published before train() returns
            except Exception as exc:  # noqa: BLE001 - the run's own error, if any, comes first
                if not failed:
                    raise
                log.warning("a background checkpoint write failed too: %s", exc)
            if self.neftune_hook_handle is not None:
                self.neftune_hook_handle.remove()
                self.neftune_hook_handle = None
            if restore is not None:
                restore()

    def _restore_found_batch_size(self, checkpoint: Path) -> None:
        """With auto_find_batch_size, a resume starts from the batch size the checkpoint's run
        settled on (trainer_state.json ``train_batch_size``), as HF does, not from the top again."""
        try:
            saved = TrainerState.load_from_json(str(checkpoint / "trainer_state.json")).train_batch_size
        except (OSError, ValueError):
            return  # the loop reports an unreadable checkpoint
        if saved:
            self._train_batch_size = int(saved)

    def evaluate(self, eval_dataset: Dataset | dict[str, Dataset] | str | None = None,
                 ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate and return metrics prefixed with ``metric_key_prefix`` (dicts: each named set)."""
        from workbench.train.evaluation import evaluate

        return evaluate(self, eval_dataset, ignore_keys, metric_key_prefix)

    def evaluation_loop(self, dataloader: DataLoader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """Run the model over ``dataloader`` (each batch through ``prediction_step``) and compute
        the metrics; evaluate() and predict() both go through here, as in HF."""
        from workbench.train.evaluation import evaluation_loop

        return evaluation_loop(self, dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)

    def predict(self, test_dataset: Dataset, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions, label ids and ``test_``-prefixed metrics for ``test_dataset``."""
        from workbench.train.evaluation import predict

        return predict(self, test_dataset, ignore_keys, metric_key_prefix)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Record ``logs`` in the state's history and hand them to the on_log callbacks."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        if self.args.include_num_input_tokens_seen != "no":
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
            if start_time is not None:
                elapsed = time.perf_counter() - start_time
                if elapsed > 0:
                    logs["train_tokens_per_second"] = round(self.state.num_input_tokens_seen / elapsed, 3)
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the weights as safetensors (and the processing class) to ``output_dir``.

        Every process calls it (FSDP gathers the weights collectively); rank 0 writes.
        Checkpoints call an override with ``_internal_call=True``, as HF's _save_checkpoint
        does (checkpoint/store.py: save_checkpoint says when).
        """
        from workbench.checkpoint.state_dicts import capture_model_state, is_fsdp
        from workbench.checkpoint.trainer_state import save_model_files

        target = Path(output_dir or self.args.output_dir)
        state = capture_model_state(self) if is_fsdp(self) else None  # None: the model's own weights
        if self.accelerator.is_main_process:
            save_model_files(unwrap_model(self.model), target, self.processing_class, state=state)
            (target / "training_args.json").write_text(self.args.to_json_string() + "\n", encoding="utf-8")
        self.accelerator.wait_for_everyone()

    # -- HF's overridable steps of the loop, with HF's names, signatures and call order ------

    def _maybe_log_save_evaluate(self, tr_loss: Any, grad_norm: Any, model: nn.Module, trial: Any, epoch: float | None,
                                 ignore_keys_for_eval: list[str] | None, start_time: float,
                                 learning_rate: float | None = None) -> None:
        """At a step or epoch end: log if asked, then evaluate (``_evaluate``; a new best metric
        asks for a save under save_strategy "best"), then save (``_save_checkpoint``, on_save).

        ``tr_loss`` is the run's loss window (reduced at the logging point, not per step).
        """
        if self.control.should_log and self.loop is not None:
            self.loop.log_loss(start_time, learning_rate)
        if self.control.should_evaluate:
            metrics = self._evaluate(trial, ignore_keys_for_eval)
            if self._determine_best_metric(metrics, trial) and self.args.save_strategy == "best":
                self.control.should_save = True  # never False: a stop's save at this step stands
        if self.control.should_save:
            self._save_checkpoint(model, trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _evaluate(self, trial: Any, ignore_keys_for_eval: list[str] | None, skip_scheduler: bool = False) -> dict[str, float]:
        """An evaluation during training (HF's step: ``evaluate`` with the training's ignore keys),
        then a plateau schedule's step on its metric."""
        metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)
        if not skip_scheduler:
            step_on_metric(self.lr_scheduler, self.args.metric_for_best_model, metrics)
        return metrics

    def _determine_best_metric(self, metrics: dict[str, float], trial: Any) -> bool:
        """Track ``metric_for_best_model``; True when this evaluation is the new best. An
        evaluation a stop cut short never counts."""
        name = self.args.metric_for_best_model
        if name is None or any(k.endswith("_interrupted") for k in metrics):
            return False
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            shown = ", ".join(sorted(k for k in metrics if not is_timing_metric(k)))
            raise KeyError(
                f"metric_for_best_model: the evaluation returned no {key!r}; it returned: {shown}. "
                "Set metric_for_best_model to one of these (with or without the eval_ prefix)"
            )
        value = float(metrics[key])
        best = self.state.best_metric
        better = best is None or (value > best if self.args.greater_is_better else value < best)
        if better and math.isfinite(value):
            self.state.best_metric = value
            self.state.best_global_step = self.state.global_step
            return True
        return False

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> Path | None:
        """Write ``checkpoint-<step>`` into ``_get_output_dir(trial)``: every save of the run,
        including a paused or stop-time one, goes through here. Returns its path (rank 0)."""
        from workbench.checkpoint.trainer_state import save_checkpoint

        return save_checkpoint(self)

    def fork_between_steps(self, action: str, order: dict[str, Any]) -> None:
        """Take part in rank 0's fork, keep, discard (train/forking.py) or variant save
        (train/fork_save.py) on this rank."""
        if action == "save_variant":
            from workbench.train.fork_save import save_variant

            save_variant(self, self.fork_ends[order["name"]], Path(order["folder"]), order["why"], order["record"])
            return
        from workbench.train.forking import follow_fork

        follow_fork(self, action, order)

    def _get_output_dir(self, trial: Any = None) -> str:
        """Where checkpoints go (HF's hook; hyperparameter-search runs would add a run folder)."""
        return self.args.output_dir
