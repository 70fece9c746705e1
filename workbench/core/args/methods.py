"""The members of HF's TrainingArguments that scripts call, beside the fields.

Two mixins of :class:`workbench.TrainingArguments`: :class:`ProcessMembers` (which process
this is, whether it logs or saves, ``main_process_first``) read Accelerate's distributed
state, made once by :func:`workbench.core.world.distributed_state` with these
arguments (as the Trainer makes it, so asking early never changes the run);
:class:`ArgumentSetters` are HF's grouped ``set_*`` helpers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from workbench.core.args.enums import (
    IntervalStrategy, OptimizerNames, ParallelMode, SaveStrategy, SchedulerType,
)

__all__ = ["ProcessMembers", "ArgumentSetters", "LOG_LEVELS"]

# HF's log level names; "passive" leaves the level as the application set it.
LOG_LEVELS = {"detail": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR, "critical": logging.CRITICAL, "passive": -1}


class ProcessMembers:
    """Where this process stands in the run (HF's properties of the same names)."""

    @property
    def distributed_state(self) -> Any:
        """Accelerate's PartialState for this run (made with these arguments on first use)."""
        from workbench.core.world import distributed_state

        return distributed_state(self)

    @property
    def world_size(self) -> int:
        """The number of processes training together."""
        return self.distributed_state.num_processes

    @property
    def process_index(self) -> int:
        """This process's rank among all of them."""
        return self.distributed_state.process_index

    @property
    def local_process_index(self) -> int:
        """This process's rank on its machine."""
        return self.distributed_state.local_process_index

    @property
    def parallel_mode(self) -> ParallelMode:
        """DISTRIBUTED with several processes, else NOT_PARALLEL (workbench has no DataParallel)."""
        from accelerate.utils import DistributedType

        if self.distributed_state.distributed_type != DistributedType.NO:
            return ParallelMode.DISTRIBUTED
        return ParallelMode.NOT_PARALLEL

    @property
    def should_log(self) -> bool:
        """Whether this process logs: each machine's first with log_on_each_node, else rank 0."""
        return (self.local_process_index if self.log_on_each_node else self.process_index) == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes files: each machine's first with save_on_each_node, else rank 0."""
        return (self.local_process_index if self.save_on_each_node else self.process_index) == 0

    @property
    def place_model_on_device(self) -> bool | None:
        """HF's hook for integrations that place the model themselves (None: the Trainer decides)."""
        return None

    def get_process_log_level(self) -> int:
        """The logging level for this process: ``log_level`` where it logs (should_log), else
        ``log_level_replica``; "passive" is the ``workbench`` logger's current level."""
        name = self.log_level if self.should_log else self.log_level_replica
        level = LOG_LEVELS[name]
        return logging.getLogger("workbench").getEffectiveLevel() if level == -1 else level

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """Run the block on the main process first, the others after it (e.g. a ``datasets``
        map that caches its result): the main process of each machine with ``local``, the
        run's rank 0 without. One process: just runs the block. ``desc`` names the work in
        debug logs."""
        if self.world_size == 1:
            yield
            return
        state = self.distributed_state
        logging.getLogger("workbench").debug("%d: %s first for %s", self.process_index,
                                             "the local main process" if local else "the main process", desc)
        with (state.local_main_process_first() if local else state.main_process_first()):
            yield


class ArgumentSetters:
    """HF's grouped setters: each sets a few fields and returns the arguments.

    As in HF they assign without re-running ``__post_init__``'s checks (the Trainer reads
    the values as given); a strategy name is checked at once.
    """

    def set_training(self, learning_rate: float = 5e-5, batch_size: int = 8, weight_decay: float = 0,
                     num_epochs: float = 3, max_steps: int = -1, gradient_accumulation_steps: int = 1,
                     seed: int = 42, activation_checkpointing: bool = False,
                     gradient_checkpointing: bool | None = None) -> Any:
        """The basic training settings; sets ``do_train``."""
        self.do_train = True
        self.learning_rate, self.per_device_train_batch_size = learning_rate, batch_size
        self.weight_decay, self.num_train_epochs, self.max_steps = weight_decay, num_epochs, max_steps
        self.gradient_accumulation_steps, self.seed = gradient_accumulation_steps, seed
        if gradient_checkpointing is not None:  # the older name wins when given, as in HF
            activation_checkpointing = gradient_checkpointing
        self.activation_checkpointing = self.gradient_checkpointing = activation_checkpointing
        return self

    def set_evaluate(self, strategy: str = "no", steps: int = 500, batch_size: int = 8,
                     accumulation_steps: int | None = None, delay: float | None = None,
                     loss_only: bool = False) -> Any:
        """When and how to evaluate; ``do_eval`` follows the strategy."""
        self.eval_strategy = _choice(IntervalStrategy, strategy, "strategy")
        _need_steps(self.eval_strategy, steps)
        self.do_eval = self.eval_strategy != IntervalStrategy.NO
        self.eval_steps, self.per_device_eval_batch_size = steps, batch_size
        self.eval_accumulation_steps, self.eval_delay, self.prediction_loss_only = accumulation_steps, delay, loss_only
        return self

    def set_testing(self, batch_size: int = 8, loss_only: bool = False) -> Any:
        """Prediction on a held-out set; sets ``do_predict``."""
        self.do_predict = True
        self.per_device_eval_batch_size, self.prediction_loss_only = batch_size, loss_only
        return self

    def set_save(self, strategy: str = "steps", steps: int = 500, total_limit: int | None = None,
                 on_each_node: bool = False) -> Any:
        """When to save checkpoints and how many to keep."""
        self.save_strategy = _choice(SaveStrategy, strategy, "strategy")
        _need_steps(self.save_strategy, steps)
        self.save_steps, self.save_total_limit, self.save_on_each_node = steps, total_limit, on_each_node
        return self

    def set_logging(self, strategy: str = "steps", steps: int = 500, report_to: str | list[str] = "none",
                    level: str = "passive", first_step: bool = False, nan_inf_filter: bool = False,
                    on_each_node: bool = False, replica_level: str = "passive") -> Any:
        """When to log, where to report, and at which levels."""
        self.logging_strategy = _choice(IntervalStrategy, strategy, "strategy")
        _need_steps(self.logging_strategy, steps)
        self.logging_steps, self.report_to, self.log_level = steps, report_to, level
        self.logging_first_step, self.logging_nan_inf_filter = first_step, nan_inf_filter
        self.log_on_each_node, self.log_level_replica = on_each_node, replica_level
        return self

    def set_push_to_hub(self, model_id: str, strategy: str = "every_save", token: str | None = None,
                        private_repo: bool | None = None, always_push: bool = False,
                        revision: str | None = None) -> Any:
        """Refused: workbench never talks to the Hugging Face Hub."""
        raise ValueError(f"set_push_to_hub: pushing to the Hugging Face Hub ({model_id!r}) is not supported by "
                         "workbench; save locally (output_dir) and upload the folder yourself")

    def set_optimizer(self, name: str = "adamw_torch", learning_rate: float = 5e-5, weight_decay: float = 0,
                      beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8,
                      args: str | None = None) -> Any:
        """The optimizer and its hyperparameters (a name torch cannot build is refused at once)."""
        from workbench.core.args.enums import unserved_optimizer

        self.optim = _choice(OptimizerNames, name, "name")
        problem = unserved_optimizer(self.optim)
        if problem is not None:
            raise ValueError(f"set_optimizer: {problem}")
        self.learning_rate, self.weight_decay, self.optim_args = learning_rate, weight_decay, args
        self.adam_beta1, self.adam_beta2, self.adam_epsilon = beta1, beta2, epsilon
        return self

    def set_lr_scheduler(self, name: str = "linear", num_epochs: float = 3.0, max_steps: int = -1,
                         warmup_steps: float = 0) -> Any:
        """The learning-rate schedule and the run's length."""
        self.lr_scheduler_type = _choice(SchedulerType, name, "name")
        self.num_train_epochs, self.max_steps, self.warmup_steps = num_epochs, max_steps, warmup_steps
        return self

    def set_dataloader(self, train_batch_size: int = 8, eval_batch_size: int = 8, drop_last: bool = False,
                       num_workers: int = 0, pin_memory: bool = True, persistent_workers: bool = False,
                       prefetch_factor: int | None = None, multiprocessing_context: str | None = None,
                       in_order: bool = True, auto_find_batch_size: bool = False, ignore_data_skip: bool = False,
                       sampler_seed: int | None = None) -> Any:
        """How the data loaders are built."""
        self.per_device_train_batch_size, self.per_device_eval_batch_size = train_batch_size, eval_batch_size
        self.dataloader_drop_last, self.dataloader_num_workers = drop_last, num_workers
        self.dataloader_pin_memory, self.dataloader_persistent_workers = pin_memory, persistent_workers
        self.dataloader_prefetch_factor = prefetch_factor
        self.dataloader_multiprocessing_context, self.dataloader_in_order = multiprocessing_context, in_order
        self.auto_find_batch_size, self.ignore_data_skip, self.data_seed = auto_find_batch_size, ignore_data_skip, sampler_seed
        return self


def _choice(enum_cls: type, value: Any, name: str) -> Any:
    try:
        return enum_cls(value)
    except ValueError:
        raise ValueError(f"{name}: {value!r} is not one of: {', '.join(e.value for e in enum_cls)}") from None


def _need_steps(strategy: Any, steps: Any) -> None:
    if strategy == "steps" and steps == 0:
        raise ValueError("steps: the \"steps\" strategy needs a positive number of steps")
