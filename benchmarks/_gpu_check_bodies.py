"""The checks of gpu_checks.py, one function each (that file's docstring says what each one
checks and why). Each runs in a process of its own, started by gpu_checks.py:

    python benchmarks/_gpu_check_bodies.py NAME DEVICE RESULT_FILE LIMIT_SECONDS

and writes ``{"status", "summary", "figures"}`` to RESULT_FILE. ``rank-worker DEVICE OUT``
is one rank of the ``ranks`` check, started by Accelerate's launcher.

A check returns an :class:`Outcome` (FAIL when it found problems, each named), raises
:class:`Skip` where it does not apply, and any other exception is a FAIL with its traceback
in the log.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from _timing import Stopwatch, round_robin
from torch import nn
from torch.utils.data import Dataset, Subset

from workbench import Guard, Session, Trainer, TrainerCallback, TrainingArguments
from workbench.guard import checks as guard_checks

DEVICE = "cpu"  # set by configure(): "cuda" or "cpu"
CUDA = False
MIB = 2**20


class Skip(Exception):
    """The check does not apply on this machine (the message says why)."""


@dataclass
class Outcome:
    status: str  # PASS, FAIL or SKIP
    summary: str
    figures: dict[str, Any] = field(default_factory=dict)


def verdict(problems: list[str], summary: str, figures: dict[str, Any]) -> Outcome:
    """FAIL naming the problems (then the figures' summary), else PASS."""
    if problems:
        return Outcome("FAIL", "; ".join(problems) + " | " + summary, figures)
    return Outcome("PASS", summary, figures)


def configure(device: str) -> None:
    """Use ``device`` for every run of this process."""
    global DEVICE, CUDA
    DEVICE, CUDA = device, device == "cuda"
    if not CUDA:
        torch.set_num_threads(1)  # these checks are about code paths, not CPU speed; cores are shared


# -- shared pieces -------------------------------------------------------------------------


def train_args(out: str | Path, **overrides: Any) -> TrainingArguments:
    """Quiet arguments for a short run on this process's device."""
    options: dict[str, Any] = {"output_dir": str(out), "report_to": "none", "disable_tqdm": True,
                               "save_strategy": "no", "logging_steps": 10, "seed": 42, "use_cpu": not CUDA}
    options.update(overrides)
    return TrainingArguments(**options)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def host_weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().to("cpu", copy=True) for p in model.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def all_finite(weights: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(w).all()) for w in weights)


class Clock(TrainerCallback):
    """Times the training loop (first hook to last) into a Stopwatch."""

    def __init__(self, watch: Stopwatch) -> None:
        self.watch = watch

    def on_train_begin(self, args, state, control, **kwargs):
        sync()
        self.watch.begin()

    def on_train_end(self, args, state, control, **kwargs):
        sync()
        self.watch.end()


@dataclass
class LM:
    """The tiny GPT workload: its data, vocabulary, model size and batch on this device."""

    train: Dataset
    eval: Dataset
    vocab: int
    batch: int

    def model(self) -> nn.Module:
        from workbench.models import TinyGPT

        torch.manual_seed(0)
        if CUDA:  # large enough that the GPU's precision shows in the step time
            return TinyGPT(vocab_size=self.vocab, n_layer=6, n_head=12, n_embd=768, block_size=128)
        return TinyGPT(vocab_size=self.vocab, n_layer=2, n_head=4, n_embd=128, block_size=128)  # the demo's


def lm() -> LM:
    from workbench.data.builtin import builtin_tokenizer, load_builtin_data

    train, eval_ = load_builtin_data("python-source", block_size=128, max_chars=400_000)
    return LM(train, eval_, builtin_tokenizer("python-source").vocab_size, 32 if CUDA else 8)


def losses_of(trainer: Trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


# -- 6. environment ----------------------------------------------------------------------


def check_env(limit: float) -> Outcome:
    import accelerate

    import workbench

    figures: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                               "accelerate": accelerate.__version__, "workbench": workbench.__version__,
                               "cpus": os.cpu_count()}
    base = f"torch {torch.__version__} | accelerate {accelerate.__version__} | python {figures['python']}"
    if not CUDA:
        return Outcome("PASS", f"{base} | CPU, {os.cpu_count()} cores (--device cpu: the GPUs are hidden)", figures)
    if not torch.cuda.is_available():
        return Outcome("FAIL", f"torch.cuda.is_available() is False ({base}, built for CUDA {torch.version.cuda}): "
                               "install a CUDA build of torch, or run --device cpu", figures)
    props = torch.cuda.get_device_properties(0)
    figures.update(device=props.name, capability=f"{props.major}.{props.minor}", gpus=torch.cuda.device_count(),
                   memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), nccl=_nccl_version(),
                   bf16=torch.cuda.is_bf16_supported(), tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                   driver=_driver_version())
    x = torch.ones(64, 64, device="cuda")
    problems = [] if float((x @ x).sum()) == 64**3 else ["a 64x64 matmul on the GPU gave a wrong sum"]
    return verdict(problems, f"{base} | {props.name} (sm_{props.major}{props.minor}, {figures['memory_gib']} GiB, "
                             f"{figures['gpus']} GPU) | CUDA {torch.version.cuda}, cuDNN {figures['cudnn']}, "
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
    steps, repeats = (60, 2) if CUDA else (8, 1)
    modes = ["fp32", "bf16", "fp16"] if CUDA else ["fp32", "bf16"]
    notes = [] if CUDA else ["fp16 SKIP (needs CUDA: the Trainer refuses fp16 on the CPU)"]
    if CUDA and not torch.cuda.is_bf16_supported():
        modes.remove("bf16")
        notes.append("bf16 SKIP (this GPU has no bf16)")
    runs = itertools.count()
    with tempfile.TemporaryDirectory(prefix="precision-") as tmp:

        def one(mode: str, n: int) -> dict[str, Any]:
            watch = Stopwatch()
            args = train_args(f"{tmp}/{next(runs)}", max_steps=n, per_device_train_batch_size=work.batch,
                              learning_rate=1e-3 if CUDA else 3e-3, logging_steps=max(n // 6, 1), bf16=mode == "bf16",
                              fp16=mode == "fp16")
            trainer = Trainer(model=work.model(), args=args, train_dataset=work.train, callbacks=[Clock(watch)])
            output = trainer.train()
            scaler = trainer.accelerator.scaler
            return {"rate": n / watch.loop, "losses": losses_of(trainer), "train_loss": output.training_loss,
                    "mixed_precision": str(trainer.accelerator.mixed_precision),
                    "scale": scaler.get_scale() if scaler is not None else None}

        if CUDA:
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
    steps = 10 if CUDA else 4
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
        devices = ("cpu", "gpu") if CUDA else ("cpu",)
        wanted = [f"{stage}_mem_{dev}_{kind}_delta" for stage in ("init", "train", "eval") for dev in devices
                  for kind in ("alloc", "peaked")]
        missing = [k for k in wanted if k not in mem]
        if missing:
            problems.append(f"metrics missing: {', '.join(missing)}")
        if not CUDA and any("_gpu_" in k for k in mem):
            problems.append("GPU memory metrics on a CPU run")
        if CUDA and not missing:
            if mem["init_mem_gpu_alloc_delta"] < 0.9 * params:
                problems.append(f"init_mem_gpu_alloc_delta {mem['init_mem_gpu_alloc_delta']} < the "
                                f"parameters' {params}")
            if mem["train_mem_gpu_alloc_delta"] <= 0:
                problems.append("train_mem_gpu_alloc_delta <= 0 (AdamW's state is made in train)")
            for key in ("train_mem_gpu_peaked_delta", "eval_mem_gpu_peaked_delta"):
                if mem[key] <= 0:
                    problems.append(f"{key} = {mem[key]} (activations should peak above the end)")
        reading = _session_memory(work, f"{tmp}/session", limit / 2, problems)
    expected_device = "cuda" if CUDA else "cpu"
    if reading is not None:
        if reading.device_type != expected_device:
            problems.append(f"the Session's memory says device {reading.device_type}")
        if reading.parameters != params:
            problems.append(f"the Session's memory says {reading.parameters} parameter bytes, not {params}")
        if reading.optimizer_state < 2 * params:  # AdamW: two moments per parameter
            problems.append(f"the Session's memory says {reading.optimizer_state} optimizer bytes (< 2 x params)")
        if CUDA and not (reading.device_allocated and reading.device_allocated > 0
                         and (reading.device_reserved or 0) >= reading.device_allocated
                         and (reading.device_peak or 0) >= reading.device_allocated):
            problems.append(f"implausible GPU figures {reading.device_allocated}/{reading.device_reserved}/"
                            f"{reading.device_peak} (allocated/reserved/peak)")
        if not CUDA and reading.device_allocated is not None:
            problems.append("a CPU run reports device_allocated")
        if reading.host_rss <= 0:
            problems.append("host_rss <= 0")
    dev = "gpu" if CUDA else "cpu"
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

N, DIM, BATCH = 64, 8, 4  # 16 steps of a linear regression, as tests/test_guard.py


class Poisoned(Dataset):
    """Regression rows with an id; rows in ``nan_ids`` give a NaN loss, rows in ``spike_ids``
    a loss ``spike`` times larger (the pattern of tests/test_guard.py)."""

    def __init__(self, nan_ids=(), spike_ids=(), spike: float = 400.0) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, DIM, generator=gen)
        self.y = self.x @ torch.randn(DIM, 1, generator=gen)
        self.mult = torch.ones(N)
        self.mult[list(spike_ids)] = spike
        self.mult[list(nan_ids)] = float("nan")

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i], "mult": self.mult[i], "idx": i}


class Regression(nn.Module):
    """A linear model whose per-sample loss is scaled by ``mult``; ``poison`` makes it NaN."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(DIM, 1)
        self.poison = False

    def forward(self, x, labels=None, mult=None, idx=None):
        out = self.lin(x)
        loss = (((out - labels) ** 2).squeeze(-1) * mult).mean()
        return {"loss": loss * float("nan") if self.poison else loss, "logits": out}


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
        loop = self.trainer._training_loop
        checks = loop.guard.checks if loop is not None and loop.guard is not None else None
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
                      use_cpu=where == "host" or not CUDA)
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
            tolerance = 0.0 if not CUDA else 1e-4 * (1 + scale)
            if diff > tolerance:
                problems.append(f"{optim}: weights differ from the host path's by {diff:.3g} (> {tolerance:.3g})")
            if len(got) == 2 and len(ref) == 2 and isinstance(got[1]["value"], float) \
                    and not math.isclose(got[1]["threshold"], ref[1]["threshold"], rel_tol=1e-4):
                problems.append(f"{optim}: spike threshold {got[1]['threshold']} vs host {ref[1]['threshold']}")
            parts.append(f"{optim} ({used.kind}): flagged {[s for s, _ in found]}, |w - host| {diff:.1e}")
    forced = "" if CUDA else " (device path forced on the CPU)"
    return verdict(problems, " | ".join(parts) + forced, figures)


# -- 3b. no host sync on non-logging steps ---------------------------------------------------

SYNC_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


class SyncWatch:
    """Host syncs between step begin and step end of the steps that do not log.

    Two counters: Python-level reads of tensors by the training thread (``.item()``,
    ``.tolist()``, ``bool()``...; on the GPU only reads of GPU tensors), the CPU proxy of
    tests/test_session.py; and on CUDA the warnings of ``torch.cuda.set_sync_debug_mode``,
    switched on only inside those windows, which also catch syncs no Python method shows
    (a blocking copy, ``nonzero``, a Python scalar copied to the device).
    """

    def __init__(self) -> None:
        self.windows = 0
        self.reads = 0  # in windows
        self.total = 0  # all reads by the training thread (the patch works if > 0)
        self.where: list[str] = []
        self.warnings: list[str] = []
        self.active = False
        self.thread: threading.Thread | None = None

    def callbacks(self) -> tuple[TrainerCallback, TrainerCallback]:
        """(first callback: opens a window at a non-logging step's begin, last: closes it)."""
        watch = self

        class Open(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                watch.thread = threading.current_thread()

            def on_step_begin(self, args, state, control, **kwargs):
                nxt = state.global_step + 1
                if nxt % state.logging_steps and nxt < state.max_steps:
                    watch.windows += 1
                    watch.active = True
                    if CUDA:
                        torch.cuda.set_sync_debug_mode("warn")

        class Close(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if watch.active and CUDA:
                    torch.cuda.set_sync_debug_mode("default")
                watch.active = False

        return Open(), Close()

    def _wrap(self, name: str, original: Callable) -> Callable:
        watch = self

        def counted(tensor, *args, **kwargs):
            if threading.current_thread() is watch.thread and (not CUDA or tensor.device.type != "cpu"):
                watch.total += 1
                if watch.active:
                    watch.reads += 1
                    frame = traceback.extract_stack(limit=2)[0]
                    watch.where.append(f"{name} at {frame.filename}:{frame.lineno}")
            return original(tensor, *args, **kwargs)

        return counted

    @property
    def syncs(self) -> int:
        """Syncs seen in the windows: on CUDA a GPU tensor's read also warns, so the larger
        of the two counts, not their sum."""
        return max(self.reads, len(self.warnings))

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Count reads and record sync warnings (from any thread) while the block runs."""
        originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}
        for name, original in originals.items():
            setattr(torch.Tensor, name, self._wrap(name, original))
        try:
            with warnings.catch_warnings(record=True) as caught, _stderr_captured() as stderr:
                warnings.simplefilter("always")
                yield
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
            if CUDA:
                torch.cuda.set_sync_debug_mode("default")
        self.warnings = [f"{w.filename}:{w.lineno}" for w in caught if _is_sync_warning(w)]
        # Warnings raised outside Python's reach (the autograd engine's threads) go to stderr.
        self.warnings += [line.strip()[:120] for line in stderr if "synchroniz" in line]


@contextlib.contextmanager
def _stderr_captured() -> Iterator[list[str]]:
    """File descriptor 2 into a list of lines while the block runs (then echoed to stderr)."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read()
            sys.stderr.write(text)
            lines.extend(text.splitlines())


def _is_sync_warning(w: warnings.WarningMessage) -> bool:
    return "synchroniz" in str(w.message)


def _sync_debug_works() -> bool:
    """Whether a deliberate sync under the debug mode reaches us as a warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            torch.ones(1, device="cuda").item()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return any(_is_sync_warning(w) for w in caught)


class ReadEachStep(TrainerCallback):
    """The control row's deliberate host sync at every step begin (the counters must see it)."""

    def on_step_begin(self, args, state, control, **kwargs):
        torch.ones((), device=DEVICE).item()


def sync_row(work: LM, out: str, steps: int, log_every: int, timeout: float, guard: Guard | None = None,
             session: bool = False, optim: str = "adamw_torch_fused", control: bool = False,
             **precision: bool) -> SyncWatch:
    """One run of the tiny GPT under a SyncWatch (``control``: with a sync at every step)."""
    watch = SyncWatch()
    first, last = watch.callbacks()
    args = train_args(out, max_steps=steps, logging_steps=log_every, per_device_train_batch_size=work.batch,
                      optim=optim, **precision)
    callbacks = [first, ReadEachStep()] if control else [first]
    trainer = Trainer(model=work.model(), args=args, train_dataset=work.train, callbacks=callbacks, guard=guard)
    run = _run_session_with_poller(Session(trainer), timeout) if session else trainer.train
    trainer.add_callback(last)  # after the Session's callback: its step-end work is inside the window
    with watch.watching():
        run()
    if trainer.state.global_step != steps:
        raise RuntimeError(f"the run stopped at step {trainer.state.global_step} of {steps}")
    return watch


def _run_session_with_poller(session: Session, timeout: float) -> Callable[[], None]:
    """A run of ``session`` while another thread reads snapshot() every 5 ms (a busy front-end)."""

    def run() -> None:
        done = threading.Event()

        def poll() -> None:
            while not done.wait(0.005):
                session.snapshot()

        poller = threading.Thread(target=poll, name="poller", daemon=True)
        poller.start()
        try:
            session.start()
            status = session.wait(timeout)
        finally:
            done.set()
            poller.join(5)
            session.close()
        if status != "finished":
            raise RuntimeError(f"the Session's run ended {status}")

    return run


def check_sync(limit: float) -> Outcome:
    problems: list[str] = []
    if CUDA and not _sync_debug_works():  # the rows still run: the tensor-read counter works without it
        problems.append("set_sync_debug_mode('warn') gave no warning for a deliberate .item()")
    # The accelerator path on the CPU too (there the host path reads the loss each step by design).
    guard_checks.HOST_DECIDES_ON_CPU = False
    work = lm()
    steps, log_every = (20, 10) if CUDA else (8, 4)
    windows = steps - steps // log_every  # every step but the logging ones (the last logs)
    guard = Guard(nonfinite="skip", spike="skip", window=4)
    rows: dict[str, dict[str, Any]] = {
        "plain": {}, "guard adamw": {"guard": guard}, "guard sgd": {"guard": guard, "optim": "sgd"},
        "session+poller": {"session": True}, "bf16+guard": {"guard": guard, "bf16": True}}
    info = {"fp16+guard": {"guard": guard, "fp16": True}} if CUDA else {}  # the loss scaler's own reads
    # The control row syncs at every step on purpose: counting nothing there means the counters are blind.
    control = {"control": {"session": True, "control": True}}
    parts: list[str] = []
    figures: dict[str, Any] = {"windows_expected": windows}
    with tempfile.TemporaryDirectory(prefix="sync-") as tmp:
        for i, (name, options) in enumerate({**control, **rows, **info}.items()):
            watch = sync_row(work, f"{tmp}/{i}", steps, log_every, limit / 3, **options)
            figures[name] = {"windows": watch.windows, "reads": watch.reads, "reads_total": watch.total,
                             "where": sorted(set(watch.where))[:5], "sync_warnings": len(watch.warnings),
                             "warned_at": sorted(set(watch.warnings))[:5]}
            syncs = watch.syncs
            text = f"{name} {syncs}"
            if name in info:
                text += " (info)"
            elif name in control:
                text += " (must be >0)"
                if syncs < windows:
                    problems.append(f"control: {syncs} syncs counted, expected >= {windows}: the counters are blind")
            elif watch.windows != windows:
                problems.append(f"{name}: {watch.windows} windows, expected {windows}")
            elif syncs:
                problems.append(f"{name}: {syncs} syncs at {sorted(set(watch.where + watch.warnings))[:3]}")
            if not CUDA and watch.total == 0:
                problems.append(f"{name}: no tensor read counted at all (the counter is not working)")
            parts.append(text)
    how = "set_sync_debug_mode warnings + GPU tensor reads" if CUDA else "tensor reads (CPU proxy; device path forced)"
    return verdict(problems, f"syncs in {windows} non-logging steps: " + ", ".join(parts) + f" [{how}]", figures)


# -- 4. checkpoints: async round trip, blocked times, pinned staging --------------------------


class Wide(nn.Module):
    """``layers`` square linear layers: ~100M parameters at width 4096 x 6."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks += [nn.Linear(width, width)] + ([nn.GELU()] if i < layers - 1 else [])
        self.layers = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.layers(x), labels)}


class Noise(Dataset):
    """64 rows of Gaussian inputs and targets of ``width``, the same for every run."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(self.width, generator=g), "labels": torch.randn(self.width, generator=g)}


class Weights(TrainerCallback):
    """Host copies of the weights when the loop starts, at step ``at`` and at the end."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.seen: dict[Any, list[torch.Tensor]] = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.seen["begin"] = host_weights(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at:
            self.seen[self.at] = host_weights(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.seen["end"] = host_weights(model)


def _small_run(out: str, resume: str | None = None) -> dict[Any, list[torch.Tensor]]:
    """8 steps of a small MLP regression with an async save at step 4 (and 8).

    Linear layers and an MSE loss: kernels that are deterministic on a GPU as they are
    (``full_determinism`` would refuse CUDA's NLLLoss, and the comparison needs no more).
    """
    torch.manual_seed(0)
    args = train_args(out, max_steps=8, per_device_train_batch_size=8, learning_rate=1e-3, logging_steps=4,
                      save_strategy="steps", save_steps=4, save_async=True)
    weights = Weights(4)
    trainer = Trainer(model=Wide(256, 2), args=args, train_dataset=Noise(256), callbacks=[weights])
    trainer.train(resume_from_checkpoint=resume)
    return weights.seen


def _round_trip(tmp: str, problems: list[str]) -> str:
    from workbench.checkpoint.store import CheckpointStore

    whole = _small_run(f"{tmp}/whole")
    checkpoint = Path(tmp, "whole", "checkpoint-4")
    ok, reason = CheckpointStore(f"{tmp}/whole").verify(checkpoint)
    if not ok:
        problems.append(f"the async checkpoint does not verify: {reason}")
    resumed = _small_run(f"{tmp}/resumed", resume=str(checkpoint))
    loaded = max_diff(resumed["begin"], whole[4])
    final = max_diff(resumed["end"], whole["end"])
    if loaded:
        problems.append(f"the weights loaded from the async checkpoint differ by {loaded:.3g}")
    if final:
        again = max_diff(_small_run(f"{tmp}/again")["end"], whole["end"])
        if not again:
            problems.append(f"resumed final weights differ by {final:.3g} (two whole runs agree bitwise)")
        return f"resume NOT bitwise (final |dw| {final:.2g}; two whole runs differ by {again:.2g} too)"
    return "async save -> resume bitwise equal (loaded and after 4 more steps)"


def _blocked_times(tmp: str) -> tuple[str, dict[str, Any]]:
    """Seconds the loop would be blocked: a rollback snapshot, a sync save, an async save;
    and the state's host copy plain vs into reused pinned buffers (CUDA only)."""
    from workbench.guard.ring import RollbackPoint
    from workbench.checkpoint.state_dicts import host_copy

    width, layers, repeats = (4096, 6, 2) if CUDA else (1024, 3, 2)
    with torch.device(DEVICE):  # made on the device: initializing 100M parameters on the host is slow
        model = Wide(width, layers)
    trainer = Trainer(model=model, args=train_args(f"{tmp}/wide", max_steps=2, per_device_train_batch_size=2,
                                                   learning_rate=1e-4, save_total_limit=1),
                      train_dataset=Noise(width))
    trainer.train()  # makes AdamW's state
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    tensors = [*model.state_dict().values(),
               *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim())]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    writes: list[float] = []

    def timed(fn: Callable[[], Any]) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    def save(save_async: bool) -> float:
        trainer.args.save_async = save_async
        trainer.state.global_step += 1  # a new checkpoint name each time (save_total_limit keeps one)
        blocked = timed(lambda: trainer._save_checkpoint(trainer.model, None))
        if save_async:
            writes.append(timed(trainer.checkpoint_writer.wait))  # the background write, not blocking
        return blocked

    rows: dict[str, Callable[[], float]] = {
        "snapshot": partial(timed, lambda: RollbackPoint.take(trainer, {"ring": [], "pos": 0, "seen": 0})),
        "sync save": partial(save, False),
        "async save": partial(save, True),
        "host copy .to(cpu)": partial(timed, lambda: host_copy(tensors)),
    }
    pin_alloc = None
    if CUDA:
        start = time.perf_counter()
        buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        pin_alloc = time.perf_counter() - start

        def pinned() -> None:
            for buffer, tensor in zip(buffers, tensors):
                buffer.copy_(tensor, non_blocking=True)

        rows["pinned reused, non_blocking"] = partial(timed, pinned)
    results = round_robin(rows, repeats)
    med = {name: statistics.median(values) for name, values in results.items()}
    params = sum(p.numel() for p in model.parameters())
    figures = {"parameters": params, "state_bytes": nbytes, "seconds": results, "async_write_seconds": writes,
               "pin_alloc_seconds": pin_alloc}
    text = (f"{params / 1e6:.1f}M params + AdamW ({nbytes / 2**30:.2f} GiB), ms median of {repeats}: "
            f"snapshot {med['snapshot'] * 1e3:.0f}, sync save {med['sync save'] * 1e3:.0f}, "
            f"async save blocked {med['async save'] * 1e3:.0f} (write {statistics.median(writes) * 1e3:.0f}), "
            f".to(cpu) {med['host copy .to(cpu)'] * 1e3:.0f} ({nbytes / med['host copy .to(cpu)'] / 1e9:.1f} GB/s)")
    if CUDA:
        fast = med["pinned reused, non_blocking"]
        text += f", pinned {fast * 1e3:.0f} ({nbytes / fast / 1e9:.1f} GB/s; first pin {pin_alloc * 1e3:.0f})"
    else:
        text += ", pinned SKIP (needs CUDA)"
    return text, figures


def check_checkpoint(limit: float) -> Outcome:
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="checkpoint-") as tmp:
        round_trip = _round_trip(tmp, problems)
        blocked, figures = _blocked_times(tmp)
    return verdict(problems, f"{round_trip} | {blocked}", figures)


# -- 5. rank agreement ----------------------------------------------------------------------


class PoisonRank1(TrainerCallback):
    """Only rank 1's loss of step 3 is NaN."""

    def __init__(self, model: Regression) -> None:
        self.model = model

    def on_step_begin(self, args, state, control, **kwargs):
        self.model.poison = state.global_step + 1 == 3 and torch.distributed.get_rank() == 1


def rank_worker(out: str) -> None:
    """One rank of the ``ranks`` check: a guarded run where only rank 1 sees a NaN."""
    guard_checks.HOST_DECIDES_ON_CPU = False  # CPU ranks take the accelerator path too
    model = Regression()
    args = train_args(out, max_steps=6, per_device_train_batch_size=4, learning_rate=0.05, logging_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=Poisoned(), callbacks=[PoisonRank1(model)],
                      guard=Guard(nonfinite="skip"))
    trainer.train()
    rank = torch.distributed.get_rank()
    result = {"interventions": trainer.workbench_state.guard["interventions"],
              "backend": torch.distributed.get_backend(),
              "weights": [p.detach().cpu().flatten().tolist() for p in model.parameters()]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    trainer.accelerator.wait_for_everyone()  # leave together (tests/test_guard.py says why)
    torch.distributed.destroy_process_group()


def check_ranks(limit: float) -> Outcome:
    if CUDA and torch.cuda.device_count() < 2:
        raise Skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()} (NCCL refuses two ranks on one device)")
    from workbench.distributed.launch import launcher_command

    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        out = Path(tmp, "out")
        out.mkdir()
        command, env = launcher_command(2, [str(Path(__file__).resolve()), "rank-worker", DEVICE, str(out)])
        env["OMP_NUM_THREADS"] = "1"
        # Same process group as this check: gpu_checks.py's time limit kills the ranks with it.
        result = subprocess.run(command, env=env, cwd=tmp)
        if result.returncode != 0:
            return Outcome("FAIL", f"the 2-rank launch exited {result.returncode} (its output is in the log)")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in (0, 1)]
    problems = []
    found = [[(i["step"], i["rank"]) for i in r["interventions"]] for r in ranks]
    if found != [[(3, 0)], [(3, 1)]]:
        problems.append(f"interventions {found}, expected step 3 on both ranks")
    if ranks[0]["weights"] != ranks[1]["weights"]:
        problems.append("the replicas' weights differ")
    if not all(math.isfinite(v) for w in ranks[0]["weights"] for v in w):
        problems.append("non-finite weights")
    return verdict(problems, f"2 {ranks[0]['backend']} ranks, NaN on rank 1 only: skipped at {found}",
                   {"ranks": ranks})


CHECK_BODIES: dict[str, Callable[[float], Outcome]] = {
    "env": check_env, "precision": check_precision, "memory": check_memory, "guard": check_guard,
    "sync": check_sync, "checkpoint": check_checkpoint, "ranks": check_ranks,
}


def main(argv: list[str]) -> None:
    if argv[0] == "rank-worker":
        configure(argv[1])
        rank_worker(argv[2])
        return
    name, device, result_file, limit = argv[0], argv[1], Path(argv[2]), float(argv[3])
    configure(device)
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
