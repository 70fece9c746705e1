"""What an A/B fork from a paused run costs (issue 28), per variant, against a training step.

For each workload (the overhead benchmark's MLP, overhead-bound, and tiny GPT, compute-bound)
a run is paused after some steps and forked into variants; measured:

* ``snapshot``: taking the pause point (host copies of weights, optimizer, schedule, RNG,
  counters: train/forking.py ``Boundary.take``), as each variant's end is taken too;
* ``restore``: putting the run back at it (once after each variant);
* ``variant step``: a variant's training step (outside the loop, no callbacks or logs);
* ``loop step``: the same run's own step (the loop with its callbacks and gates);
* ``memory``: host bytes one copy holds (a fork of k variants holds k + 1);
* ``save_variant``: a variant saved on purpose as a checkpoint of its own (train/fork_save.py),
  against ``checkpoint_save``, the run's own checkpoint of the pause.

The overhead of a fork per variant is snapshot + restore (+ its evaluation, not counted
here), to compare with the variant's own ``steps`` x step.

Results (CPU VM, OMP_NUM_THREADS=2, 10 repeats): MLP snapshot 0.20 ms + restore 0.29 ms =
0.40 of a 1.23 ms loop step, 0.08 MiB per variant; tiny GPT (2 x 128) snapshot 1.08 ms +
restore 1.31 ms = 0.03 of a 73 ms step, 4.9 MiB per variant. A variant's own step is 1.3x /
1.2x the loop's (one host read of its loss per step for the curves, and its batches'
fingerprint). A variant saved on purpose: MLP 9.6 ms against 6.8 ms for the run's own checkpoint
of the pause, tiny GPT 30.9 ms against 26.6 ms (1.16x: a boundary taken and two restores around
the same save).

Usage: python benchmarks/fork.py [--workload mlp|lm|all] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from overhead import lm_workload, mlp_workload  # noqa: E402

from workbench import Session, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from workbench.train.forking import Boundary, fork_memory  # noqa: E402


class _PauseAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step, self.session, self.began, self.ended = step, None, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 5 and self.began is None:
            self.began = time.perf_counter()  # after the first steps' warm-up

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.ended = time.perf_counter()
            self.session.pause()


def measure(work, pause_at: int, variant_steps: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(out, max_steps=10 * pause_at, per_device_train_batch_size=work.batch,
                                 learning_rate=work.lr, lr_scheduler_type="linear", save_strategy="no",
                                 logging_steps=50, report_to="none", disable_tqdm=True)
        pause = _PauseAt(pause_at)
        trainer = Trainer(model=work.make_model(), args=args, train_dataset=work.train, callbacks=[pause])
        session = Session(trainer, control=False)
        pause.session = session
        session.start()
        deadline = time.monotonic() + 600
        while session.status != "paused":
            if time.monotonic() > deadline:
                raise RuntimeError("the run did not pause")
            time.sleep(0.01)
        loop_step = (pause.ended - pause.began) / (pause_at - 5)
        takes, restores = [], []
        for _ in range(repeats):
            began = time.perf_counter()
            point = Boundary.take(trainer)
            takes.append(time.perf_counter() - began)
            began = time.perf_counter()
            point.restore(trainer)
            restores.append(time.perf_counter() - began)
        report = session.fork({"a": {}, "b": {"lr_scale": 0.5}}, steps=variant_steps, evaluate=False)
        variant_step = statistics.median(v["seconds"] / variant_steps for v in report["variants"].values())
        memory = fork_memory(trainer)
        # A variant saved on purpose (its end state put in, written, the pause put back) against
        # the run's own checkpoint of the pause, side by side in this run.
        saves = []
        for i in range(min(repeats, 5)):
            began = time.perf_counter()
            session.save_variant("b", Path(out) / f"variant-{i}")
            saves.append(time.perf_counter() - began)
        began = time.perf_counter()
        session.save()
        plain_save = time.perf_counter() - began
        session.stop(save=False)
        session.wait(60)
    return {"workload": work.key, "snapshot_ms": 1e3 * statistics.median(takes),
            "restore_ms": 1e3 * statistics.median(restores), "loop_step_ms": 1e3 * loop_step,
            "variant_step_ms": 1e3 * variant_step, "memory_mib_per_variant": memory / 2**20,
            "overhead_in_steps": (statistics.median(takes) + statistics.median(restores)) / loop_step,
            "save_variant_ms": 1e3 * statistics.median(saves), "checkpoint_save_ms": 1e3 * plain_save}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("mlp", "lm", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=20)
    ns = parser.parse_args()
    works = {"mlp": [(mlp_workload, 200, 100)], "lm": [(lm_workload, 20, 10)]}
    chosen = works["mlp"] + works["lm"] if ns.workload == "all" else works[ns.workload]
    for make, pause_at, steps in chosen:
        print(json.dumps(measure(make(), pause_at, steps, ns.repeats)))


if __name__ == "__main__":
    main()
