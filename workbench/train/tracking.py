"""Where logs go: ``output_dir/events.jsonl`` (always, on the main process; the file's
format is workbench/core/event_file.py) and, by ``report_to``, extra sinks. Sinks are plain callbacks, so they see exactly what the loop
reports through ``on_log`` / ``on_evaluate`` / ``on_save``.
"""

from __future__ import annotations


import os
import traceback
from pathlib import Path
from typing import Any

from workbench.core.args.training import REPORT_SINKS
from workbench.core.event_file import EventFile
from workbench.core.exit_codes import EXIT_FAILED, run_exit_code
from workbench.core.callbacks import TrainerCallback

__all__ = ["EventLogCallback", "TrackioCallback", "TensorBoardCallback", "reporting_callbacks", "SINKS"]



class EventLogCallback(TrainerCallback):
    """Writes start, log, eval, sample, save, end and error events (main process only).

    ``end`` and ``error`` say how the run ended, with the code ``workbench run`` exits with:
    clients that find the run gone (``workbench ctl``, an attached dashboard) read it here.
    ``stop`` is the trainer's agreed stop decision (who stopped it, whether it saved). start,
    end and error name the writing process (rank 0's pid, the one control.json names)."""

    def __init__(self, stop: Any = None, ledger: Any = None, throughput: Any = None) -> None:
        self.log: EventFile | None = None
        self.stop = stop
        self.ledger = ledger  # the run's time ledger: its summary goes into the end record
        self.throughput = throughput  # the rates of the steps logged (train/throughput.py)

    def _out(self, args, state) -> EventFile | None:
        if not state.is_world_process_zero:
            return None
        if self.log is None or self.log.path.parent != Path(args.output_dir):
            self.log = EventFile(args.output_dir)
        return self.log

    def on_train_begin(self, args, state, control, **kwargs):
        out = self._out(args, state)
        if out:
            out.write("start", state.global_step, max_steps=state.max_steps, run_name=args.run_name or args.output_dir,
                      num_train_epochs=state.num_train_epochs, train_batch_size=state.train_batch_size,
                      pid=os.getpid())

    def on_log(self, args, state, control, logs=None, **kwargs):
        out = self._out(args, state)
        if out and logs and not any(k.startswith(("eval_", "test_")) for k in logs):
            # The rates go into the record, not into HF's log_history (kept as transformers has it).
            # They win over HF's cumulative train_tokens_per_second (include_num_input_tokens_seen:
            # since the start, idle time included), so the record says what the snapshot and ctl say.
            rates = self.throughput.latest if self.throughput is not None and "loss" in logs else {}
            out.write("log", state.global_step, **{**logs, **rates})

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        out = self._out(args, state)
        if out:
            out.write("eval", state.global_step, **{"epoch": state.epoch, **(metrics or {})})

    def on_save(self, args, state, control, **kwargs):
        out = self._out(args, state)
        if out:
            out.write("save", state.global_step, checkpoint=f"checkpoint-{state.global_step}")

    def on_sample(self, args, state, control, samples=None, **kwargs):
        out = self._out(args, state)
        for sample in (samples or ()) if out else ():  # one record per prompt: {prompt, answer, tokens}
            out.write("sample", state.global_step, **sample)

    def on_train_end(self, args, state, control, **kwargs):
        out = self._out(args, state)
        if out:
            status = "stopped" if state.global_step < state.max_steps else "finished"
            stop = self.stop if self.stop is not None and self.stop.is_set() else None
            reason, saved = (stop.reason, bool(stop.save)) if stop is not None else (None, True)
            ledger = {"time_ledger": self.ledger.summary()} if self.ledger is not None else {}
            if ledger and self.ledger.by_rank:  # several ranks: each one's, gathered as the loop ended
                ledger["time_ledger_ranks"] = {**self.ledger.by_rank, "0": ledger["time_ledger"]}
            out.write("end", state.global_step, epoch=state.epoch, status=status, stop_reason=reason, saved=saved,
                      exit_code=run_exit_code(status, reason, saved), pid=os.getpid(), **ledger)

    def on_error(self, args, state, control, error=None, model=None, optimizer=None, **kwargs):
        out = self._out(args, state)
        if out and error is not None and not isinstance(error, KeyboardInterrupt):
            if _is_out_of_memory(error):
                # What filled the memory, recorded while the tensors still exist.
                from workbench.train.memory import memory_report

                out.write("oom", state.global_step, **memory_report(model, optimizer).to_dict())
            out.write("error", state.global_step, error=f"{type(error).__name__}: {error}",
                      traceback="".join(traceback.format_exception(error)), exit_code=EXIT_FAILED,
                      pid=os.getpid())


def _is_out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


class TrackioCallback(TrainerCallback):
    """``report_to="trackio"``: project, run name and arguments at start, then every log and
    evaluation. Without a Space it writes trackio's local store (works offline)."""

    def __init__(self) -> None:
        self._run = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or self._run is not None:
            return
        import trackio

        self._trackio = trackio
        self._run = trackio.init(project=args.project, name=args.run_name, config=args.to_sanitized_dict(),
                                 resume="allow", embed=False, auto_log_cpu=False, auto_log_gpu=False)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._run is None or not logs:
            return
        numbers = {k: v for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._trackio.log(numbers, step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self._run is not None:
            self._trackio.finish()
            self._run = None

    on_error = on_train_end


class TensorBoardCallback(TrainerCallback):
    """``report_to="tensorboard"``: scalars under ``output_dir/runs`` (needs the tensorboard package)."""

    def __init__(self) -> None:
        self._writer = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or self._writer is not None:
            return
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(Path(args.output_dir) / "runs"))
        self._writer.add_text("args", args.to_json_string())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._writer is None or not logs:
            return
        for key, value in logs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                name = key.replace("eval_", "eval/", 1) if key.startswith("eval_") else f"train/{key}"
                self._writer.add_scalar(name, value, state.global_step)
        self._writer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    on_error = on_train_end


# The callback of each report_to sink (args.REPORT_SINKS names the package it needs).
SINKS: dict[str, type[TrainerCallback] | None] = {
    "jsonl": None,  # EventLogCallback is always on
    "trackio": TrackioCallback,
    "tensorboard": TensorBoardCallback,
}


def reporting_callbacks(args, stop: Any = None, ledger: Any = None, throughput: Any = None) -> list[TrainerCallback]:
    """The sinks for ``args.report_to``; the events.jsonl log is always on (``stop``: the
    trainer's stop decision, which its end record reports with the ``ledger``'s summary and,
    with several ranks, each rank's)."""
    import importlib.util

    callbacks: list[TrainerCallback] = [EventLogCallback(stop, ledger, throughput)]
    for name in args.report_to:
        cls, package = SINKS[name], REPORT_SINKS[name]
        if cls is None:
            continue
        if package and importlib.util.find_spec(package) is None:
            raise ValueError(f"report_to: {name!r} needs the {package} package (pip install {package})")
        callbacks.append(cls())
    return callbacks
