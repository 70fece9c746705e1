"""Fine-tuning costs, side by side in one run: LoRA against full fine-tuning, and samples.

1. LoRA vs full fine-tuning of the same Llama-style model (built locally by
   workbench/models/tiny_llama.py, width ``--hidden``, ``--layers`` blocks) on the same chat
   rows through workbench's Trainer: steps/s (the loop after a warm-up, saves excluded), the
   model's own tensor bytes (parameters, gradients, optimizer state) at the end, the bytes
   of one checkpoint on disk, and peak memory. Each of these runs is a fresh process of its
   own (spawned), so its peak RSS (``getrusage`` ``ru_maxrss``) is that variant's alone, not
   the high-water mark of every run before it; on a GPU, torch's ``max_memory_allocated``
   too. Peak RSS includes the interpreter, torch and the loaded base model, the same in both
   variants, so the difference between the rows is what full fine-tuning adds (gradients,
   optimizer state, their temporaries). Rows alternate over the repetitions.
2. Samples: the same LoRA run with and without a SamplesCallback (2 prompts, 16 new tokens,
   at each evaluation): seconds each sample point adds, and the step time between sample
   points (the ratio shows it costs nothing there).

Usage: python benchmarks/finetune.py [--steps N] [--repeats R] [--hidden H] [--layers L]

Measured with the defaults on 2 shared CPU cores (a test suite running beside it):
    full fine-tuning    21.3 steps/s  optimizer 19.27 MiB  checkpoint 28.97 MiB  peak RSS 530.21 MiB
    LoRA r=8 (q,k,v,o)  27.0 (1.26x)  optimizer  0.44 MiB  checkpoint  0.73 MiB  peak RSS 515.53 MiB
    a sample point 14 ms median; steps between sample points 41.89 vs 44.08 ms without (0.95)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from workbench import Trainer, TrainerCallback, TrainingArguments
from workbench.core.trainer_utils import unwrap_model
from workbench.data.collators import DataCollatorForSeq2Seq
from workbench.models.adapters import apply_lora, parameter_split
from workbench.models.tiny_llama import build_chat_tokenizer, build_tiny_llama, chat_rows
from workbench.train.memory import memory_report
from workbench.train.samples import SamplesCallback

LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
WARMUP = 5


class TimedSamples(SamplesCallback):
    """The SamplesCallback, with the seconds each of its sample points took."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seconds: list[float] = []

    def on_evaluate(self, args, state, control, **kwargs):
        start = time.perf_counter()
        result = super().on_evaluate(args, state, control, **kwargs)
        self.seconds.append(time.perf_counter() - start)
        return result


class StepClock(TrainerCallback):
    """Seconds inside steps (begin to end) after the warm-up, and the loop's wall time."""

    def __init__(self) -> None:
        self.step_seconds: list[float] = []
        self._began = 0.0
        self.loop = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.loop = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self._began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > WARMUP:
            self.step_seconds.append(time.perf_counter() - self._began)

    def on_train_end(self, args, state, control, **kwargs):
        self.loop = time.perf_counter() - self.loop


def _data(tokenizer, rows: int):
    import datasets

    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in chat_rows(rows)]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


def _run(folder: Path, tokenizer, data, out: str, *, lora: bool, steps: int, samples: bool = False,
         eval_steps: int | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    if lora:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = apply_lora(model, LORA)
    clock = StepClock()
    callbacks: list = [clock]
    sampler = TimedSamples(prompts=["What is 2 plus 3?", "What is 4 plus 5?"], max_new_tokens=16) if samples else None
    if sampler is not None:
        callbacks.append(sampler)
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=16, learning_rate=1e-3,
                             logging_steps=steps, save_strategy="steps" if not eval_steps else "no", save_steps=steps,
                             eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps,
                             per_device_eval_batch_size=16, report_to="none", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data.select(range(16)),
                      processing_class=tokenizer, data_collator=DataCollatorForSeq2Seq(tokenizer), callbacks=callbacks)
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's own log lines
        trainer.train()
    report = memory_report(unwrap_model(trainer.model), trainer.optimizer)
    checkpoint = Path(out) / f"checkpoint-{steps}"
    size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()) if checkpoint.is_dir() else 0
    trained, frozen = parameter_split(unwrap_model(trainer.model))
    return {"steps/s": 1.0 / statistics.median(clock.step_seconds), "step_s": statistics.median(clock.step_seconds),
            "loop": clock.loop, "tensors": report.parameters + report.gradients + report.optimizer_state,
            "params": report.parameters, "grads": report.gradients, "optim": report.optimizer_state,
            "checkpoint": size, "trained": trained, "frozen": frozen,
            "sample_points": sampler.seconds if sampler is not None else []}


def _peak_rss() -> int:
    """This process's peak resident set size so far, in bytes (ru_maxrss is KiB on Linux,
    bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _variant(folder: str, out: str, lora: bool, steps: int) -> dict:
    """One LoRA or full run in this (fresh) process, with its peak memory: what a spawned
    worker runs, so each variant's peak RSS starts from a bare interpreter."""
    from transformers import AutoTokenizer

    torch.set_num_threads(1)  # as the parent: steps/s stay comparable with the in-process runs
    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = _data(tokenizer, 256)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = _run(Path(folder), tokenizer, data, out, lora=lora, steps=steps)
    result["peak_rss"] = _peak_rss()
    result["cuda_peak"] = torch.cuda.max_memory_allocated() if cuda else None
    return result


def _isolated(folder: Path, out: str, *, lora: bool, steps: int) -> dict:
    """``_variant`` in a spawned process of its own (a fork would inherit the parent's pages
    and its peak RSS with them)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_variant, str(folder), out, lora, steps).result()


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        tokenizer = build_chat_tokenizer(folder)
        build_tiny_llama(folder, vocab_size=len(tokenizer), hidden=opts.hidden, layers=opts.layers)
        data = _data(tokenizer, 256)
        rows: dict[str, list[dict]] = {"full fine-tuning": [], "LoRA r=8 (q,k,v,o)": []}
        for repeat in range(opts.repeats):
            order = list(rows) if repeat % 2 == 0 else list(reversed(rows))
            for name in order:
                out = os.path.join(tmp, f"{name[:4]}-{repeat}")
                rows[name].append(_isolated(folder, out, lora=name.startswith("LoRA"), steps=opts.steps))
        print(f"1. LoRA vs full fine-tuning: Llama hidden {opts.hidden}, {opts.layers} layers, batch 16, "
              f"{opts.steps} steps, median of {opts.repeats}, each run a process of its own")
        gpu = any(r["cuda_peak"] is not None for results in rows.values() for r in results)
        print(f"{'run':<22} {'steps/s':>8} {'ratio':>6} {'trained':>10} {'frozen':>10} {'tensors':>11} "
              f"{'optim':>10} {'checkpoint':>11} {'peak RSS':>11} {'vs full':>11}" + (f" {'GPU peak':>11}" if gpu else ""))
        base = statistics.median(r["steps/s"] for r in rows["full fine-tuning"])
        full_rss = statistics.median(r["peak_rss"] for r in rows["full fine-tuning"])
        for name, results in rows.items():
            rate = statistics.median(r["steps/s"] for r in results)
            rss = statistics.median(r["peak_rss"] for r in results)
            last = results[-1]
            line = (f"{name:<22} {rate:>8.1f} {rate / base:>6.2f} {last['trained']:>10,} {last['frozen']:>10,} "
                    f"{_mib(last['tensors']):>11} {_mib(last['optim']):>10} {_mib(last['checkpoint']):>11} "
                    f"{_mib(rss):>11} {'+' if rss >= full_rss else '-'}{_mib(abs(rss - full_rss)):>10}")
            if gpu:
                line += f" {_mib(statistics.median(r['cuda_peak'] for r in results)):>11}"
            print(line)

        eval_steps = 10
        points = opts.steps // eval_steps
        timed: dict[str, list[dict]] = {"LoRA, no samples": [], "LoRA, samples at each eval": []}
        for repeat in range(opts.repeats):
            order = list(timed) if repeat % 2 == 0 else list(reversed(timed))
            for name in order:
                out = os.path.join(tmp, f"s-{len(timed[name])}-{name[-4:]}")
                timed[name].append(_run(folder, tokenizer, data, out, lora=True, steps=opts.steps,
                                        samples="samples at" in name, eval_steps=eval_steps))
        per_point = [t for r in timed["LoRA, samples at each eval"] for t in r["sample_points"]]
        step_plain = statistics.median(r["step_s"] for r in timed["LoRA, no samples"])
        step_samples = statistics.median(r["step_s"] for r in timed["LoRA, samples at each eval"])
        print(f"\n2. Samples (2 prompts x 16 new tokens, greedy) at each of {points} evaluations, {opts.repeats} runs")
        print(f"a sample point: {statistics.median(per_point) * 1e3:.0f} ms median ({min(per_point) * 1e3:.0f}-"
              f"{max(per_point) * 1e3:.0f}), {statistics.median(per_point) / step_plain:.1f} steps' time")
        print(f"step time between sample points: {step_plain * 1e3:.2f} ms without samples, {step_samples * 1e3:.2f} ms "
              f"with (ratio {step_samples / step_plain:.3f})")


if __name__ == "__main__":
    main()
