"""Per-step overhead: workbench's Trainer vs a plain PyTorch loop, side by side.

Same model, data, optimizer (AdamW), linear schedule, gradient clipping and batch size;
the runs alternate within one invocation and the table reports medians, so machine
noise hits every row alike. Usage: python benchmarks/overhead.py [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader

from workbench import Trainer, TrainingArguments
from workbench.data import load_builtin_data
from workbench.models import MLPClassifier


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MLPClassifier(in_features=32, hidden=64, num_classes=4, n_layer=2)


def plain_loop(steps: int, batch: int, train) -> float:
    """The baseline: what a careful person writes by hand."""
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (steps - s) / steps))
    loader = DataLoader(train, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    done = 0
    start = time.perf_counter()
    while done < steps:
        for inputs in loader:
            loss = model(**inputs)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                break
    return steps / (time.perf_counter() - start)


def workbench_trainer(steps: int, batch: int, train, out: str) -> float:
    args = TrainingArguments(out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-3,
                             lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=100,
                             save_strategy="no", report_to="none", disable_tqdm=True, optim="adamw_torch_fused")
    trainer = Trainer(model=make_model(0), args=args, train_dataset=train)
    start = time.perf_counter()
    trainer.train()
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    ns = parser.parse_args()
    torch.set_num_threads(1)  # overhead-bound on purpose: the model is tiny
    train, _ = load_builtin_data("random-classification", n_train=8192)
    import tempfile

    results: dict[str, list[float]] = {"plain PyTorch loop": [], "workbench Trainer": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(ns.repeats):
            results["plain PyTorch loop"].append(plain_loop(ns.steps, ns.batch, train))
            results["workbench Trainer"].append(workbench_trainer(ns.steps, ns.batch, train, tmp))
    base = statistics.median(results["plain PyTorch loop"])
    print(f"small MLP, batch {ns.batch}, {ns.steps} steps x {ns.repeats} repeats (median steps/s)")
    print(f"{'runner':<22} {'steps/s':>9} {'ratio':>7}")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"{name:<22} {med:>9.1f} {med / base:>7.3f}")


if __name__ == "__main__":
    main()
