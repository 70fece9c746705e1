"""The data pipeline across processes, end to end: batch_rebalance and the samplers sharded over
two real processes, each rank's batches checked against one process's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from support import REPO, free_port
from test_data_pipeline import DATA_HEAD

_TWO_RANK_SCRIPT = '''
import json, random, sys
import torch
from torch.utils.data import Dataset
from workbench import Trainer, TrainingArguments
from workbench.data.collators import DataCollatorForLanguageModeling
from workbench.data.builtin import CharTokenizer
from workbench.data.samplers import start_loader_epoch
from workbench.models import TinyGPT

out = sys.argv[1]
rng = random.Random(0)
lengths = [rng.randint(20, 30) if rng.random() < 0.3 else rng.randint(3, 10) for _ in range(100)]

class Rows(Dataset):
    def __len__(self):
        return len(lengths)
    def __getitem__(self, i):
        return {"idx": i, "input_ids": [2 + (i + j) % 90 for j in range(lengths[i])]}

def args(**kw):
    return TrainingArguments(out, per_device_train_batch_size=4, gradient_accumulation_steps=2, report_to="none",
                             disable_tqdm=True, save_strategy="no", train_sampling_strategy="batch_rebalance",
                             logging_steps=1, use_cpu=True, **kw)

def record(features):
    return {"idx": torch.tensor([f["idx"] for f in features]),
            "cost": torch.tensor(len(features) * max(len(f["input_ids"]) for f in features))}

torch.manual_seed(0)
model = TinyGPT(vocab_size=99, n_layer=1, n_head=2, n_embd=16, block_size=32)
trainer = Trainer(model=model, args=args(max_steps=1, remove_unused_columns=False), train_dataset=Rows(),
                  data_collator=record)
loader = trainer.get_train_dataloader()
start_loader_epoch(loader, 0, trainer.args.seed)
batches = [{"idx": b["idx"].tolist(), "cost": int(b["cost"])} for b in loader]
lm = DataCollatorForLanguageModeling(CharTokenizer(), mlm=False)
trainer = Trainer(model=model, args=args(max_steps=4), train_dataset=Rows(), data_collator=lm)
result = trainer.train()
rank = trainer.accelerator.process_index
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump({"rank": rank, "world": trainer.accelerator.num_processes, "batches": batches,
               "loss": result.training_loss}, f)
# Tear the gloo group down before the interpreter exits: left to exit-time destructors it
# can abort ("terminate called without an active exception") on a loaded machine.
trainer.accelerator.wait_for_everyone()
import torch.distributed as dist
if dist.is_initialized():
    dist.destroy_process_group()
'''


def test_headless_cli_shows_a_tokenizing_progress_line(tmp_path):
    (tmp_path / "t.txt").write_text("".join(f"line {i} " + "ab" * i + "\n" for i in range(40)))
    cfg = tmp_path / "c.toml"
    cfg.write_text(DATA_HEAD + textwrap.dedent("""\
        [data]
        train = { path = "t.txt" }
        text_column = "text"
        max_length = 16
        packing = true
        [training]
        output_dir = "out"
        max_steps = 1
        per_device_train_batch_size = 2
        report_to = "none"
        """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "workbench.cli", "run", str(cfg), "--headless"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Tokenizing train" in result.stderr and "100%" in result.stderr
    assert "done: 1 steps" in result.stdout


def test_batch_rebalance_two_processes_under_accelerate_launch(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # With Accelerate 1.15 on a CPU-only machine "--cpu --num_processes 2" starts one process;
    # "--multi_gpu" starts two, which form a gloo group (DistributedType.MULTI_CPU) only when the
    # Accelerator is made with cpu=True (use_cpu=True in the script); otherwise each is alone.

    def launch() -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", str(free_port()), str(script), str(tmp_path)]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)

    result = launch()
    if result.returncode != 0:
        # The rendezvous port is picked free, then bound by the launcher: on a shared machine
        # another process can take it in between. One more try on a new port; its stderr is
        # what the assertion shows.
        first = result.stderr[-1500:]
        result = launch()
        assert result.returncode == 0, f"first try:\n{first}\nsecond try:\n{result.stderr[-3000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2] and [r["rank"] for r in ranks] == [0, 1]
    per_rank = [r["batches"] for r in ranks]
    assert len(per_rank[0]) == len(per_rank[1]) == 13  # 6 full steps x 2 micro-batches + a short last step
    everything = sorted(i for batches in per_rank for b in batches for i in b["idx"])
    assert everything == list(range(100))  # together every sample exactly once
    for start in range(0, 12, 2):  # each optimizer step: balanced padded tokens on both ranks
        totals = [sum(b["cost"] for b in batches[start:start + 2]) for batches in per_rank]
        assert max(totals) / min(totals) < 1.25, totals
        assert sum(len(b["idx"]) for batches in per_rank for b in batches[start:start + 2]) == 16
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in ranks)  # DDP trained on uneven micro-batches
