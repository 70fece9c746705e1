"""Cost of the per-step control exchange between ranks (distributed.py), side by side.

Two CPU ranks (gloo) train the same model with the exchange on (what every multi-process
run does: one all-reduce of 10 integers per step) and off (the Trainer without its
RankSync, safe here because nothing asks for a stop or a pause). Rows alternate within one
invocation; the table shows medians of steps/s. The MLP is the worst case (a step is a
fraction of a millisecond, DDP's own gradient all-reduce included); the tiny LM is a step
of realistic weight.

Usage: python benchmarks/rank_sync.py [--steps N] [--repeats R]   (starts its own 2 ranks)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _trainer(workload: str, steps: int, out: str):
    from workbench import Trainer, TrainingArguments
    from workbench.data.builtin import load_builtin_data
    from workbench.models import MLPClassifier, TinyGPT

    import torch

    torch.manual_seed(0)
    if workload == "mlp":
        model = MLPClassifier(in_features=32, hidden=64, num_classes=4, n_layer=2)
        train, _ = load_builtin_data("random-classification", n_train=4096, n_eval=8, in_features=32, num_classes=4)
        batch = 32
    else:
        train, _ = load_builtin_data("python-source", block_size=64, max_chars=200_000)
        model = TinyGPT(vocab_size=99, block_size=64, n_layer=2, n_head=4, n_embd=64)
        batch = 8
    args = TrainingArguments(out, max_steps=steps, per_device_train_batch_size=batch, logging_steps=50,
                             save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
                             max_grad_norm=1.0, lr_scheduler_type="linear")
    return Trainer(model=model, args=args, train_dataset=train)


def _rank_main(ns: argparse.Namespace) -> None:
    import torch.distributed as dist

    rows: dict[str, list[float]] = {}
    for workload in ("mlp", "lm"):
        steps = ns.steps if workload == "mlp" else max(ns.steps // 10, 20)
        for repeat in range(ns.repeats + 1):  # the first round warms up
            # The order alternates: the first run of a pair pays for the previous one's teardown.
            for mode in (("exchange on", "exchange off") if repeat % 2 else ("exchange off", "exchange on")):
                trainer = _trainer(workload, steps, ns.out)
                if mode == "exchange off":
                    trainer._rank_sync = None
                trainer.accelerator.wait_for_everyone()
                start = time.perf_counter()
                trainer.train()
                elapsed = time.perf_counter() - start
                if repeat:
                    rows.setdefault(f"{workload}|{mode}", []).append(steps / elapsed)
    if dist.get_rank() == 0:
        Path(ns.out, "rank_sync.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="/tmp/workbench-rank-sync")
    ns = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        _rank_main(ns)
        return 0
    from workbench.distributed.launch import launcher_command

    Path(ns.out).mkdir(parents=True, exist_ok=True)
    command, env = launcher_command(2, [__file__, "--steps", str(ns.steps), "--repeats", str(ns.repeats),
                                        "--out", ns.out])
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(command, env=env)
    if result.returncode:
        return result.returncode
    rows = json.loads(Path(ns.out, "rank_sync.json").read_text())
    print(f"{'workload':<8} {'exchange on':>14} {'exchange off':>14} {'ratio on/off':>13}")
    for workload in ("mlp", "lm"):
        on = statistics.median(rows[f"{workload}|exchange on"])
        off = statistics.median(rows[f"{workload}|exchange off"])
        print(f"{workload:<8} {on:>10.1f} st/s {off:>10.1f} st/s {on / off:>13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
