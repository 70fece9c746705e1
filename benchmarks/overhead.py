"""Per-step overhead of training loops, side by side: plain PyTorch, workbench, HF, Lightning.

Every row trains the same model on the same data with the same batch size, optimizer
(AdamW, fused where this torch build has it), learning-rate schedule (linear decay, no
warm-up), gradient clipping (max norm 1.0) and shuffled batches:

* plain PyTorch loop: the baseline, what a careful person writes by hand;
* workbench Trainer: headless (disable_tqdm, report_to "none", no checkpoints, a loss log
  every 50 steps, so logging is realistic but rare);
* workbench Session: the same Trainer run by a Session, with a consumer thread reading
  snapshot() ten times a second, as the dashboard and the notebook panel do;
* transformers Trainer and Lightning, when installed, set up alike (no logging to disk,
  no checkpointing, no progress bar); a row whose package is missing says so.

Workloads: "mlp", a small MLP classifier (overhead-bound: a step takes about a
millisecond, so a framework's own per-step work shows), and "lm", the tiny-gpt demo model
on the built-in python-source data (compute-bound: a step takes about 0.1 s).

Each workload starts with one short warm-up run of every row (imports, allocator, first
calls), then the rows alternate: each repetition runs every row once, starting one row
later than the previous repetition, so drift in the machine's load hits all rows alike.
Throughput is timed from the train loop's first hook to its last (steps/s: median, min,
max over the repetitions; the ratio is to the plain loop of the same workload), with the
process CPU time per step beside it (steadier on a busy machine); what each train() call
spends outside its loop (set-up and tear-down) is the "fixed ms" column.
torch runs one thread, leaving the second core to the Session's poller and the OS.

Usage: python benchmarks/overhead.py [--steps N] [--repeats R] [--workload mlp|lm|all]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import itertools
import logging
import statistics
import tempfile
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from _timing import Stopwatch, print_table, round_robin, watch_session
from torch import nn
from torch.utils.data import DataLoader, Dataset

from workbench import Session, Trainer, TrainerCallback, TrainingArguments
from workbench.data.builtin import builtin_tokenizer, load_builtin_data
from workbench.models import MLPClassifier, TinyGPT

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LOGGING_STEPS = 50
MAX_GRAD_NORM = 1.0


# -- workloads -----------------------------------------------------------------------------


@dataclass
class Workload:
    key: str
    title: str
    steps: int  # default steps of one timed run
    batch: int
    lr: float
    train: Dataset
    make_model: Callable[[], nn.Module]  # a fresh model, same initial weights every call


def mlp_workload() -> Workload:
    train, _ = load_builtin_data("random-classification", n_train=8192)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return MLPClassifier(in_features=32, hidden=64, num_classes=4, n_layer=2)

    return Workload("mlp", "small MLP (32-64-64-4), batch 32", 1500, 32, 1e-3, train, make)


def lm_workload() -> Workload:
    # The tiny-gpt demo (examples/tiny-gpt.toml): 2 layers, 4 heads, width 128, 128-token
    # blocks of the standard library's source, 16 blocks a batch.
    train, _ = load_builtin_data("python-source", block_size=128, max_chars=400_000)
    vocab = builtin_tokenizer("python-source").vocab_size

    def make() -> nn.Module:
        torch.manual_seed(0)
        return TinyGPT(vocab_size=vocab, n_layer=2, n_head=4, n_embd=128, block_size=128)

    params = make().num_parameters() / 1e3
    return Workload("lm", f"tiny causal LM (TinyGPT 2 x 128, {params:.0f}k params), batch 16 x 128 tokens",
                    30, 16, 3e-3, train, make)


WORKLOADS = {"mlp": mlp_workload, "lm": lm_workload}


# -- the same optimizer and schedule everywhere ------------------------------------------------


def _fused_adamw_available() -> bool:
    try:
        torch.optim.AdamW([nn.Parameter(torch.zeros(1, device=DEVICE))], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


FUSED = _fused_adamw_available()
OPTIM = "adamw_torch_fused" if FUSED else "adamw_torch"  # the name both Trainers take


def adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=FUSED or None)


def linear_decay(step: int, total: int) -> float:
    return max(0.0, (total - step) / total)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


# -- the rows ------------------------------------------------------------------------------------


def plain_loop(work: Workload, steps: int, out: str) -> Stopwatch:
    """The baseline: what a careful person writes by hand."""
    model = work.make_model().to(DEVICE)
    watch = Stopwatch()
    with watch:
        opt = adamw(model, work.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, partial(linear_decay, total=steps))
        loader = DataLoader(work.train, batch_size=work.batch, shuffle=True)
        model.train()
        done = 0
        watch.begin()
        while done < steps:
            for batch in loader:
                batch = {k: v.to(DEVICE, non_blocking=True) for k, v in batch.items()}
                loss = model(**batch)["loss"]
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                done += 1
                if done == steps:
                    break
        sync()
        watch.end()
    return watch


class _WorkbenchClock(TrainerCallback):
    def __init__(self, watch: Stopwatch) -> None:
        self.watch = watch

    def on_train_begin(self, args, state, control, **kwargs):
        self.watch.begin()

    def on_train_end(self, args, state, control, **kwargs):
        self.watch.end()


def _workbench_trainer(work: Workload, steps: int, out: str) -> tuple[Trainer, Stopwatch]:
    args = TrainingArguments(out, max_steps=steps, per_device_train_batch_size=work.batch, learning_rate=work.lr,
                             lr_scheduler_type="linear", warmup_steps=0, optim=OPTIM, max_grad_norm=MAX_GRAD_NORM,
                             logging_steps=LOGGING_STEPS, save_strategy="no", report_to="none", disable_tqdm=True)
    trainer = Trainer(model=work.make_model(), args=args, train_dataset=work.train)
    watch = Stopwatch()
    trainer.add_callback(_WorkbenchClock(watch))
    return trainer, watch


def workbench_trainer(work: Workload, steps: int, out: str) -> Stopwatch:
    trainer, watch = _workbench_trainer(work, steps, out)
    with watch:
        trainer.train()
    _check_steps("workbench Trainer", trainer.state.global_step, steps)
    return watch


def workbench_session(work: Workload, steps: int, out: str) -> Stopwatch:
    trainer, watch = _workbench_trainer(work, steps, out)
    session = Session(trainer)
    with watch:
        status, polls = watch_session(session, every=0.1)
    if status != "finished" or (polls == 0 and watch.call > 0.5):
        raise RuntimeError(f"the session ended {status!r} after {polls} snapshot polls")
    _check_steps("workbench Session", trainer.state.global_step, steps)
    return watch


def hf_trainer(work: Workload, steps: int, out: str) -> Stopwatch:
    import transformers

    transformers.logging.set_verbosity_error()
    args = transformers.TrainingArguments(
        out, max_steps=steps, per_device_train_batch_size=work.batch, learning_rate=work.lr,
        lr_scheduler_type="linear", warmup_steps=0, optim=OPTIM, max_grad_norm=MAX_GRAD_NORM,
        logging_steps=LOGGING_STEPS, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_pin_memory=DEVICE.type == "cuda",  # as workbench: pinning only helps a GPU
    )
    watch = Stopwatch()

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            watch.begin()

        def on_train_end(self, args, state, control, **kwargs):
            watch.end()

    trainer = transformers.Trainer(model=_hf_compatible(work.make_model()), args=args,
                                   train_dataset=work.train, callbacks=[Clock()])
    # With disable_tqdm HF prints each log dict instead of a bar; the other rows are silent.
    trainer.remove_callback(transformers.PrinterCallback)
    with watch:
        trainer.train()
    _check_steps("transformers Trainer", trainer.state.global_step, steps)
    return watch


def _hf_compatible(model: nn.Module) -> nn.Module:
    """Give a plain module the two PreTrainedModel members transformers' Trainer reads.

    An attribute ``config`` (the workbench models keep a dict) and
    ``num_parameters(exclude_embeddings=...)``, which HF calls every step to count FLOPs.
    """
    model.config = types.SimpleNamespace(**model.config)
    count = type(model).num_parameters
    model.num_parameters = lambda exclude_embeddings=False, only_trainable=False: count(model, only_trainable)
    return model


def _lightning():
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    # Lightning sets its logger to INFO on import; its banners ("GPU available", "fit stopped") would
    # interleave with the table.
    logging.getLogger(pl.__name__).setLevel(logging.ERROR)
    return pl


def lightning_fit(work: Workload, steps: int, out: str) -> Stopwatch:
    pl = _lightning()
    watch = Stopwatch()

    class Module(pl.LightningModule):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch)["loss"]
            # The Lightning idiom for a loss log: self.log on every step (no logger here, so
            # nothing is written). It is a large part of this row's per-step cost on the MLP
            # (about 0.35 ms of CPU per step here); workbench and HF add the step's loss to a
            # device tensor and read it every logging_steps.
            self.log("train_loss", loss, logger=False)
            return loss

        def configure_optimizers(self):
            opt = adamw(self.model, work.lr)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, partial(linear_decay, total=steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Clock(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            watch.begin()

        def on_train_end(self, trainer, pl_module):
            sync()
            watch.end()

    module = Module(work.make_model())
    loader = DataLoader(work.train, batch_size=work.batch, shuffle=True)
    trainer = pl.Trainer(max_steps=steps, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         gradient_clip_val=MAX_GRAD_NORM, gradient_clip_algorithm="norm",
                         log_every_n_steps=LOGGING_STEPS, default_root_dir=out, callbacks=[Clock()])
    with watch, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the dataloader has few workers" and similar advice
        trainer.fit(module, loader)
    _check_steps("Lightning", trainer.global_step, steps)
    return watch


def _check_steps(row: str, done: int, steps: int) -> None:
    if done != steps:
        raise RuntimeError(f"{row} ran {done} optimizer steps, expected {steps}")


def _installed(*modules: str) -> str | None:
    """The version of the first of ``modules`` that is importable, else None."""
    for name in modules:
        if importlib.util.find_spec(name) is not None:
            try:
                return importlib.metadata.version(name.replace("_", "-"))
            except importlib.metadata.PackageNotFoundError:
                return "?"
    return None


# -- the table ---------------------------------------------------------------------------------


Runner = Callable[[Workload, int, str], Stopwatch]  # (workload, steps, output_dir) -> timings

ROWS: dict[str, Runner] = {
    "plain PyTorch loop": plain_loop,
    "workbench Trainer": workbench_trainer,
    "workbench Session + poller": workbench_session,
}
OPTIONAL_ROWS: dict[str, tuple[Runner, tuple[str, ...]]] = {  # runner, the packages it can use
    "transformers Trainer": (hf_trainer, ("transformers",)),
    "Lightning": (lightning_fit, ("lightning", "pytorch_lightning")),
}


def bench(work: Workload, steps: int, repeats: int, tmp: str) -> None:
    rows = dict(ROWS)
    skipped: dict[str, str] = {}  # optional rows that cannot run, with the reason
    versions = []
    for name, (runner, modules) in OPTIONAL_ROWS.items():
        version = _installed(*modules)
        if version is None:
            skipped[name] = "not installed"
        else:
            rows[name] = runner
            versions.append(f"{name.split()[0]} {version}")

    runs = itertools.count()

    def run(runner: Runner, steps: int) -> Stopwatch:
        return runner(work, steps, f"{tmp}/{work.key}-{next(runs)}")  # a fresh output_dir per run

    for name, runner in list(rows.items()):  # warm-up: imports, allocator, first calls
        try:
            run(runner, max(steps // 10, 5))
        except Exception as exc:
            if name not in OPTIONAL_ROWS:
                raise
            skipped[name] = f"failed: {type(exc).__name__}: {exc}"[:200]
            del rows[name]
    results = round_robin({name: partial(run, runner, steps) for name, runner in rows.items()}, repeats)

    rates: dict[str, list[float] | str] = {name: [steps / w.loop for w in watches] for name, watches in results.items()}
    table = {name: rates.get(name) or skipped[name] for name in [*ROWS, *OPTIONAL_ROWS]}
    # Process CPU time per step (the Session's poller thread included) is steadier than wall time
    # on a busy machine; "fixed ms" is the wall time each train() call spends outside its loop.
    cpu = {name: f"{statistics.median(w.loop_cpu for w in watches) / steps * 1e6:.0f}"
           for name, watches in results.items()}
    fixed = {name: f"{statistics.median(w.fixed for w in watches) * 1000:.0f}" for name, watches in results.items()}
    print_table(f"{work.title}: {steps} steps x {repeats} repeats, round robin (median)", table,
                baseline="plain PyTorch loop", extra={"CPU µs/step": cpu, "fixed ms": fixed})
    print(f"  torch {torch.__version__} on {DEVICE.type}, {torch.get_num_threads()} thread(s), "
          f"AdamW {'fused' if FUSED else 'foreach'}" + "".join(f", {v}" for v in versions))
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per timed run (default: 1500 for mlp, 30 for lm)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workload", choices=["mlp", "lm", "all"], default="all")
    ns = parser.parse_args()
    if ns.steps is not None and ns.steps < 1 or ns.repeats < 1:
        parser.error("--steps and --repeats must be positive")
    torch.set_num_threads(1)
    keys = list(WORKLOADS) if ns.workload == "all" else [ns.workload]
    with tempfile.TemporaryDirectory() as tmp:
        for key in keys:
            work = WORKLOADS[key]()
            bench(work, ns.steps or work.steps, ns.repeats, tmp)


if __name__ == "__main__":
    main()
