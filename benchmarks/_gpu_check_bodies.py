"""The checks of gpu_checks.py, one function each (this file: environment, precision, memory,
the guard; _gpu_check_io.py: host syncs, checkpoints, ranks) (that file's docstring says what each one
checks and why). Each runs in a process of its own, started by gpu_checks.py:

    python benchmarks/_gpu_check_bodies.py NAME DEVICE RESULT_FILE LIMIT_SECONDS

and writes ``{"status", "summary", "figures"}`` to RESULT_FILE. ``rank-worker DEVICE OUT``
is one rank of the ``ranks`` check, started by Accelerate's launcher.

A check returns an :class:`Outcome` (FAIL when it found problems, each named), raises
:class:`Skip` where it does not apply, and any other exception is a FAIL with its traceback
in the log.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from _timing import Stopwatch, round_robin
from torch.utils.data import Subset

from workbench import Guard, Session, Trainer, TrainerCallback
from workbench.guard import checks as guard_checks

import _gpu_check_common as common
from _gpu_check_common import (BATCH, N, Poisoned, Regression, MIB, Skip, Outcome, verdict, train_args, host_weights, max_diff, all_finite, Clock, LM, lm, losses_of)


# -- 6. environment ----------------------------------------------------------------------


def check_env(limit: float) -> Outcome:
    import accelerate

    import workbench

    figures: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                               "accelerate": accelerate.__version__, "workbench": workbench.__version__,
                               "cpus": os.cpu_count()}
    base = f"torch {torch.__version__} | accelerate {accelerate.__version__} | python {figures['python']}"
    if not common.CUDA:
        return Outcome("PASS", f"{base} | CPU, {os.cpu_count()} cores (--device cpu: the GPUs are hidden)", figures)
    if not torch.cuda.is_available():
        return Outcome("FAIL", f"torch.cuda.is_available() is False ({base}, built for common.CUDA {torch.version.cuda}): "
                               "install a common.CUDA build of torch, or run --device cpu", figures)
    props = torch.cuda.get_device_properties(0)
    figures.update(device=props.name, capability=f"{props.major}.{props.minor}", gpus=torch.cuda.device_count(),
                   memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), nccl=_nccl_version(),
                   bf16=torch.cuda.is_bf16_supported(), tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                   driver=_driver_version())
    x = torch.ones(64, 64, device="cuda")
    problems = [] if float((x @ x).sum()) == 64**3 else ["a 64x64 matmul on the GPU gave a wrong sum"]
    return verdict(problems, f"{base} | {props.name} (sm_{props.major}{props.minor}, {figures['memory_gib']} GiB, "
                             f"{figures['gpus']} GPU) | common.CUDA {torch.version.cuda}, cuDNN {figures['cudnn']}, "
                             f"NCCL {figures['nccl']}, driver {figures['driver']} | bf16 {figures['bf16']}", figures)


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()  # a tuple in torch 2.x, an int before
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


# -- 1. mixed precision ------------------------------------------------------------------


def check_precision(limit: float) -> Outcome:
    work = lm()
    steps, repeats = (60, 2) if common.CUDA else (8, 1)
    modes = ["fp32", "bf16", "fp16"] if common.CUDA else ["fp32", "bf16"]
    notes = [] if common.CUDA else ["fp16 SKIP (needs common.CUDA: the Trainer refuses fp16 on the CPU)"]
    if common.CUDA and not torch.cuda.is_bf16_supported():
        modes.remove("bf16")
        notes.append("bf16 SKIP (this GPU has no bf16)")
    runs = itertools.count()
    with tempfile.TemporaryDirectory(prefix="precision-") as tmp:

        def one(mode: str, n: int) -> dict[str, Any]:
            watch = Stopwatch()
            args = train_args(f"{tmp}/{next(runs)}", max_steps=n, per_device_train_batch_size=work.batch,
                              learning_rate=1e-3 if common.CUDA else 3e-3, logging_steps=max(n // 6, 1), bf16=mode == "bf16",
                              fp16=mode == "fp16")
            trainer = Trainer(model=work.model(), args=args, train_dataset=work.train, callbacks=[Clock(watch)])
            output = trainer.train()
            scaler = trainer.accelerator.scaler
            return {"rate": n / watch.loop, "losses": losses_of(trainer), "train_loss": output.training_loss,
                    "mixed_precision": str(trainer.accelerator.mixed_precision),
                    "scale": scaler.get_scale() if scaler is not None else None}

        if common.CUDA:
            for mode in modes:  # warm-up: kernels, allocator, autotuning
                one(mode, 5)
        results = round_robin({mode: partial(one, mode, steps) for mode in modes}, repeats)
    problems: list[str] = []
    parts: list[str] = []
    figures: dict[str, Any] = {"steps": steps, "repeats": repeats, "batch": work.batch}
    base = statistics.median(r["rate"] for r in results["fp32"])
    for mode, rs in results.items():
        last = rs[-1]
        losses = last["losses"]
        rate = statistics.median(r["rate"] for r in rs)
        figures[mode] = {"steps_per_s": [round(r["rate"], 2) for r in rs], "losses": losses,
                         "train_loss": last["train_loss"], "mixed_precision": last["mixed_precision"],
                         "scale": last["scale"]}
        if not all(math.isfinite(v) for v in [*losses, last["train_loss"]]):
            problems.append(f"{mode}: non-finite loss {losses}")
        elif len(losses) < 2 or not losses[-1] < losses[0]:
            problems.append(f"{mode}: the loss did not go down {losses}")
        if mode != "fp32" and last["mixed_precision"] != mode:
            problems.append(f"{mode}: the Accelerator runs mixed_precision={last['mixed_precision']}")
        if mode == "fp16" and last["scale"] is None:
            problems.append("fp16 ran without a loss scaler")
        text = f"{mode} {losses[0]:.2f}->{losses[-1]:.2f} {rate:.1f} steps/s ({rate / base:.2f}x)"
        if mode == "fp16" and last["scale"] is not None:
            text += f" scale {last['scale']:g}"
        parts.append(text)
    spread = "" if repeats == 1 else f", median of {repeats}"
    return verdict(problems, " | ".join(parts + notes) + f" [{steps} steps x {work.batch}x128 tokens{spread}]",
                   figures)


# -- 2. memory reports -------------------------------------------------------------------


def check_memory(limit: float) -> Outcome:
    from workbench.train.memory import tensor_bytes

    work = lm()
    steps = 10 if common.CUDA else 4
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="memory-") as tmp:
        model = work.model()
        params = tensor_bytes(model.parameters())
        args = train_args(f"{tmp}/metrics", max_steps=steps, per_device_train_batch_size=work.batch,
                          per_device_eval_batch_size=work.batch, skip_memory_metrics=False)
        trainer = Trainer(model=model, args=args, train_dataset=work.train,
                          eval_dataset=Subset(work.eval, range(2 * work.batch)))
        metrics = dict(trainer.train().metrics)
        metrics.update(trainer.evaluate())
        mem = {k: v for k, v in metrics.items() if "_mem_" in k}
        devices = ("cpu", "gpu") if common.CUDA else ("cpu",)
        wanted = [f"{stage}_mem_{dev}_{kind}_delta" for stage in ("init", "train", "eval") for dev in devices
                  for kind in ("alloc", "peaked")]
        missing = [k for k in wanted if k not in mem]
        if missing:
            problems.append(f"metrics missing: {', '.join(missing)}")
        if not common.CUDA and any("_gpu_" in k for k in mem):
            problems.append("GPU memory metrics on a CPU run")
        if common.CUDA and not missing:
            if mem["init_mem_gpu_alloc_delta"] < 0.9 * params:
                problems.append(f"init_mem_gpu_alloc_delta {mem['init_mem_gpu_alloc_delta']} < the "
                                f"parameters' {params}")
            if mem["train_mem_gpu_alloc_delta"] <= 0:
                problems.append("train_mem_gpu_alloc_delta <= 0 (AdamW's state is made in train)")
            for key in ("train_mem_gpu_peaked_delta", "eval_mem_gpu_peaked_delta"):
                if mem[key] <= 0:
                    problems.append(f"{key} = {mem[key]} (activations should peak above the end)")
        reading = _session_memory(work, f"{tmp}/session", limit / 2, problems)
    expected_device = "cuda" if common.CUDA else "cpu"
    if reading is not None:
        if reading.device_type != expected_device:
            problems.append(f"the Session's memory says device {reading.device_type}")
        if reading.parameters != params:
            problems.append(f"the Session's memory says {reading.parameters} parameter bytes, not {params}")
        if reading.optimizer_state < 2 * params:  # AdamW: two moments per parameter
            problems.append(f"the Session's memory says {reading.optimizer_state} optimizer bytes (< 2 x params)")
        if common.CUDA and not (reading.device_allocated and reading.device_allocated > 0
                         and (reading.device_reserved or 0) >= reading.device_allocated
                         and (reading.device_peak or 0) >= reading.device_allocated):
            problems.append(f"implausible GPU figures {reading.device_allocated}/{reading.device_reserved}/"
                            f"{reading.device_peak} (allocated/reserved/peak)")
        if not common.CUDA and reading.device_allocated is not None:
            problems.append("a CPU run reports device_allocated")
        if reading.host_rss <= 0:
            problems.append("host_rss <= 0")
    dev = "gpu" if common.CUDA else "cpu"
    mib = {key: mem.get(f"{key.split()[0]}_mem_{dev}_{key.split()[1]}_delta", 0) / MIB
           for key in ("init alloc", "train alloc", "train peaked", "eval peaked")}
    summary = (f"params {params / MIB:.1f} MiB: init {dev} alloc {mib['init alloc']:+.1f}, train {dev} alloc "
               f"{mib['train alloc']:+.1f} peak {mib['train peaked']:+.1f}, eval peak {mib['eval peaked']:+.1f} MiB")
    if reading is not None:
        summary += f" | Session: {reading.device_type}"
        if reading.device_allocated is not None:
            summary += (f" allocated {reading.device_allocated / MIB:.0f} reserved {reading.device_reserved / MIB:.0f} "
                        f"peak {reading.device_peak / MIB:.0f} MiB,")
        summary += f" optimizer {reading.optimizer_state / MIB:.1f} MiB, host RSS {reading.host_rss / MIB:.0f} MiB"
    return verdict(problems, summary, {"metrics": mem, "parameter_bytes": params,
                                       "session": reading.to_dict() if reading is not None else None})


def _session_memory(work: LM, out: str, timeout: float, problems: list[str]) -> Any:
    """The memory reading a Session's snapshot carries after a short run (None: problem noted)."""
    trainer = Trainer(model=work.model(), args=train_args(out, max_steps=3, per_device_train_batch_size=work.batch),
                      train_dataset=work.train)
    session = Session(trainer)
    try:
        session.start()
        status = session.wait(timeout)
        reading = session.snapshot().memory
    finally:
        session.close()
    if status != "finished":
        problems.append(f"the Session's run ended {status}")
    if reading is None:
        problems.append("the Session's snapshot has no memory reading")
    return reading


# -- 3a. the guard's device path ------------------------------------------------------------



class Order(TrainerCallback):
    """The sample ids of each step (a host read per step: only for the reference order)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.steps: list[list[int]] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps.append(self.trainer.last_inputs["idx"].tolist())


class ChecksUsed(TrainerCallback):
    """Which guard checks the loop built: DeviceChecks with found_inf or masking, or HostChecks."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.kind = "none"

    def on_train_begin(self, args, state, control, **kwargs):
        loop = self.trainer.loop
        guard = loop.guard if loop is not None else None
        checks = guard.monitor.checks if guard is not None and guard.active else None
        if isinstance(checks, guard_checks.DeviceChecks):
            self.kind = "device/found_inf" if checks._found_inf else "device/mask"
        elif checks is not None:
            self.kind = "host"


def guard_run(out: str, data: Poisoned, where: str, guard: Guard | None = None, optim: str = "adamw_torch_fused",
              callbacks: tuple = ()) -> Trainer:
    """16 steps of the regression; ``where``: "host" (a CPU run judged on the host) or
    "device" (this device, judged with device ops: forced so on the CPU)."""
    guard_checks.HOST_DECIDES_ON_CPU = where == "host"
    args = train_args(out, max_steps=N // BATCH, per_device_train_batch_size=BATCH, learning_rate=0.05,
                      lr_scheduler_type="linear", seed=3, logging_steps=5, optim=optim,
                      use_cpu=where == "host" or not common.CUDA)
    trainer = Trainer(model=Regression(), args=args, train_dataset=data, callbacks=list(callbacks), guard=guard)
    for callback in callbacks:
        callback.trainer = trainer
    trainer.train()
    return trainer


def check_guard(limit: float) -> Outcome:
    guard = Guard(nonfinite="skip", spike="skip", spike_factor=20.0, window=4)
    problems: list[str] = []
    parts: list[str] = []
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="guard-") as tmp:
        order = Order()
        guard_run(f"{tmp}/order", Poisoned(), "host", callbacks=(order,))
        steps = order.steps
        data = Poisoned(nan_ids=[steps[2][0]], spike_ids=[steps[9][0]])  # steps 3 and 10
        for optim, expected_kind in (("adamw_torch_fused", "device/found_inf"), ("sgd", "device/mask")):
            used = ChecksUsed()
            device = guard_run(f"{tmp}/{optim}-device", data, "device", guard, optim, (used,))
            host = guard_run(f"{tmp}/{optim}-host", data, "host", guard, optim)
            got, ref = device.workbench_state.guard["interventions"], host.workbench_state.guard["interventions"]
            found = [(r["step"], r["kind"]) for r in got]
            wd, wh = host_weights(device.model), host_weights(host.model)
            diff = max_diff(wd, wh)
            scale = max(float(w.abs().max()) for w in wh)
            figures[optim] = {"checks": used.kind, "device": got, "host": ref, "max_weight_diff": diff}
            if used.kind != expected_kind:
                problems.append(f"{optim}: the loop used {used.kind} checks, expected {expected_kind}")
            if found != [(3, "nonfinite"), (10, "spike")]:
                problems.append(f"{optim}: flagged {found}, expected [(3, 'nonfinite'), (10, 'spike')]")
            if found != [(r["step"], r["kind"]) for r in ref]:
                problems.append(f"{optim}: the host path flagged {[(r['step'], r['kind']) for r in ref]}")
            if [r.get("samples") for r in got] != [steps[2], steps[9]]:
                problems.append(f"{optim}: the records name samples {[r.get('samples') for r in got]}")
            if not all_finite(wd):
                problems.append(f"{optim}: non-finite weights after the guarded run")
            # On the CPU both paths are the same arithmetic (bitwise); a GPU's kernels round
            # differently, but a step not skipped (x400 or NaN) would be far off.
            tolerance = 0.0 if not common.CUDA else 1e-4 * (1 + scale)
            if diff > tolerance:
                problems.append(f"{optim}: weights differ from the host path's by {diff:.3g} (> {tolerance:.3g})")
            if len(got) == 2 and len(ref) == 2 and isinstance(got[1]["value"], float) \
                    and not math.isclose(got[1]["threshold"], ref[1]["threshold"], rel_tol=1e-4):
                problems.append(f"{optim}: spike threshold {got[1]['threshold']} vs host {ref[1]['threshold']}")
            parts.append(f"{optim} ({used.kind}): flagged {[s for s, _ in found]}, |w - host| {diff:.1e}")
    forced = "" if common.CUDA else " (device path forced on the CPU)"
    return verdict(problems, " | ".join(parts) + forced, figures)



from _gpu_check_io import check_checkpoint, check_ranks, check_sync, rank_worker  # noqa: E402

CHECK_BODIES: dict[str, Callable[[float], Outcome]] = {
    "env": check_env, "precision": check_precision, "memory": check_memory, "guard": check_guard,
    "sync": check_sync, "checkpoint": check_checkpoint, "ranks": check_ranks,
}


def main(argv: list[str]) -> None:
    if argv[0] == "rank-worker":
        common.configure(argv[1])
        rank_worker(argv[2])
        return
    name, device, result_file, limit = argv[0], argv[1], Path(argv[2]), float(argv[3])
    common.configure(device)
    try:
        outcome = CHECK_BODIES[name](limit)
    except Skip as skip:
        outcome = Outcome("SKIP", str(skip))
    except Exception as exc:  # any failure is this check's FAIL, with the traceback in the log
        traceback.print_exc()
        outcome = Outcome("FAIL", f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
    result_file.write_text(json.dumps({"status": outcome.status, "summary": outcome.summary,
                                       "figures": outcome.figures}, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
