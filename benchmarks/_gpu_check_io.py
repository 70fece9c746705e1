"""The GPU checks of host syncs on non-logging steps, checkpoints (async round trip, blocked
times, pinned staging) and rank agreement (gpu_checks.py says what each checks and why);
run through _gpu_check_bodies.py."""


from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from _timing import round_robin
from torch import nn
from torch.utils.data import Dataset

from workbench import Guard, Session, Trainer, TrainerCallback
from workbench.guard import checks as guard_checks

import _gpu_check_common as common
from _gpu_check_common import (Poisoned, Regression, Skip, Outcome, verdict, train_args, sync, host_weights, max_diff, LM, lm)


# -- 3b. no host sync on non-logging steps ---------------------------------------------------

SYNC_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


class SyncWatch:
    """Host syncs between step begin and step end of the steps that do not log.

    Two counters: Python-level reads of tensors by the training thread (``.item()``,
    ``.tolist()``, ``bool()``...; on the GPU only reads of GPU tensors), the CPU proxy of
    tests/session/test_session_reports.py; and on common.CUDA the warnings of ``torch.cuda.set_sync_debug_mode``,
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
                    if common.CUDA:
                        torch.cuda.set_sync_debug_mode("warn")

        class Close(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if watch.active and common.CUDA:
                    torch.cuda.set_sync_debug_mode("default")
                watch.active = False

        return Open(), Close()

    def _wrap(self, name: str, original: Callable) -> Callable:
        watch = self

        def counted(tensor, *args, **kwargs):
            if threading.current_thread() is watch.thread and (not common.CUDA or tensor.device.type != "cpu"):
                watch.total += 1
                if watch.active:
                    watch.reads += 1
                    frame = traceback.extract_stack(limit=2)[0]
                    watch.where.append(f"{name} at {frame.filename}:{frame.lineno}")
            return original(tensor, *args, **kwargs)

        return counted

    @property
    def syncs(self) -> int:
        """Syncs seen in the windows: on common.CUDA a GPU tensor's read also warns, so the larger
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
            if common.CUDA:
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
        torch.ones((), device=common.DEVICE).item()


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
    if common.CUDA and not _sync_debug_works():  # the rows still run: the tensor-read counter works without it
        problems.append("set_sync_debug_mode('warn') gave no warning for a deliberate .item()")
    # The accelerator path on the CPU too (there the host path reads the loss each step by design).
    guard_checks.HOST_DECIDES_ON_CPU = False
    work = lm()
    steps, log_every = (20, 10) if common.CUDA else (8, 4)
    windows = steps - steps // log_every  # every step but the logging ones (the last logs)
    guard = Guard(nonfinite="skip", spike="skip", window=4)
    rows: dict[str, dict[str, Any]] = {
        "plain": {}, "guard adamw": {"guard": guard}, "guard sgd": {"guard": guard, "optim": "sgd"},
        "session+poller": {"session": True}, "bf16+guard": {"guard": guard, "bf16": True}}
    info = {"fp16+guard": {"guard": guard, "fp16": True}} if common.CUDA else {}  # the loss scaler's own reads
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
            if not common.CUDA and watch.total == 0:
                problems.append(f"{name}: no tensor read counted at all (the counter is not working)")
            parts.append(text)
    how = "set_sync_debug_mode warnings + GPU tensor reads" if common.CUDA else "tensor reads (CPU proxy; device path forced)"
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
    (``full_determinism`` would refuse common.CUDA's NLLLoss, and the comparison needs no more).
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
    and the state's host copy plain vs into reused pinned buffers (common.CUDA only)."""
    from workbench.guard.ring import RollbackPoint
    from workbench.checkpoint.state_dicts import host_copy

    width, layers, repeats = (4096, 6, 2) if common.CUDA else (1024, 3, 2)
    with torch.device(common.DEVICE):  # made on the device: initializing 100M parameters on the host is slow
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
    if common.CUDA:
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
    if common.CUDA:
        fast = med["pinned reused, non_blocking"]
        text += f", pinned {fast * 1e3:.0f} ({nbytes / fast / 1e9:.1f} GB/s; first pin {pin_alloc * 1e3:.0f})"
    else:
        text += ", pinned SKIP (needs common.CUDA)"
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
    trainer.accelerator.wait_for_everyone()  # leave together (tests/guard/test_guard_ranks_e2e.py says why)
    torch.distributed.destroy_process_group()


def check_ranks(limit: float) -> Outcome:
    if common.CUDA and torch.cuda.device_count() < 2:
        raise Skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()} (NCCL refuses two ranks on one device)")
    from workbench.distributed.launch import launcher_command

    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        out = Path(tmp, "out")
        out.mkdir()
        bodies = Path(__file__).resolve().with_name("_gpu_check_bodies.py")  # the checks' entry point
        command, env = launcher_command(2, [str(bodies), "rank-worker", common.DEVICE, str(out)])
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


