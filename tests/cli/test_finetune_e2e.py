"""The fine-tuning path end to end, as a user takes it: ``workbench init --finetune --example``
(a local tiny Llama, chat data), ``workbench run`` with a LoRA adapter, chat data, samples and
the guard; a SIGKILL mid-run then ``--resume`` to bitwise-equal adapter weights; ``workbench
export --merge`` loaded by transformers with the trained model's logits; and the
prompt/completion format."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from support.finetune import assert_merged_logits  # noqa: E402
from support.processes import outcome, start_workbench, workbench  # noqa: E402
from support.waiting import wait_until  # noqa: E402

SMALL = ("--set", "training.max_steps=24", "--set", "training.eval_steps=8", "--set", "training.save_steps=8",
         "--set", "training.logging_steps=4")
# A callback that makes each step last a while, so a SIGKILL lands between two checkpoints;
# it changes no number.
SLOW_STEPS = """
import time
from workbench import TrainerCallback

class SlowSteps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.15)
"""


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("project")
    made = workbench("init", "--finetune", "--example", "ft.toml", cwd=root)
    assert made.returncode == 0, made.stderr
    assert "workbench data ft.toml --show 3" in made.stdout
    (root / "slow.py").write_text(SLOW_STEPS)
    return root


@pytest.fixture(scope="module")
def reference(project) -> Path:
    done = workbench("run", "ft.toml", "--headless", *SMALL, "--set", "training.output_dir=runs/reference",
                     cwd=project, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return project / "runs" / "reference"


def test_the_starter_config_trains_an_adapter_with_samples_and_the_guard(reference):
    checkpoints = sorted(p.name for p in reference.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-16", "checkpoint-24"]  # save_total_limit = 2
    for name in checkpoints:
        files = {p.name for p in (reference / name).iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json", "manifest.json"} <= files
        assert "model.safetensors" not in files
    events = _events(reference)
    samples = [e for e in events if e["event"] == "sample"]
    assert sorted({e["step"] for e in samples}) == [0, 8, 16, 24]  # each evaluation, eval_on_start included
    assert {e["prompt"] for e in samples} == {"What is 2 plus 3?", "What is 4 plus 5?"}
    assert all(isinstance(e["answer"], str) for e in samples)
    config = (reference / "config.toml").read_text()
    assert "[model.peft]" in config and "[guard]" in config and "[samples]" in config


def test_a_sigkilled_run_resumes_to_bitwise_equal_adapter_weights(project, reference):
    out = project / "runs" / "killed"
    slow = ("--set", 'hooks.callbacks=["slow:SlowSteps"]', "--set", "training.output_dir=runs/killed")
    run = start_workbench("run", "ft.toml", "--headless", *SMALL, *slow, cwd=project)
    try:
        wait_until(lambda: (out / "checkpoint-8" / "manifest.json").is_file() or run.poll() is not None,
                   "the first checkpoint", timeout=240)
        assert run.poll() is None, "the run ended before it could be killed"
        run.send_signal(signal.SIGKILL)
        code, _, _ = outcome(run)
    finally:
        if run.poll() is None:
            run.kill()
    assert code == -signal.SIGKILL and not (out / "checkpoint-24").exists()
    resumed = workbench("run", "ft.toml", "--headless", *SMALL, *slow, "--resume", cwd=project, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    mine, theirs = (load_file(p / "checkpoint-24" / "adapter_model.safetensors") for p in (out, reference))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_export_merge_loads_with_transformers_and_gives_the_trained_logits(project, reference):
    from peft import PeftModel

    checkpoint = reference / "checkpoint-24"
    done = workbench("export", checkpoint, "merged", "--merge", cwd=project)
    assert done.returncode == 0, done.stderr
    merged = transformers.AutoModelForCausalLM.from_pretrained(project / "merged").eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(project / "models" / "tiny-llama")
    trained = PeftModel.from_pretrained(base, checkpoint).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(project / "merged")
    batch = tokenizer.apply_chat_template([{"role": "user", "content": "What is 4 plus 4?"}],
                                          add_generation_prompt=True, return_tensors="pt", return_dict=True)
    bare = transformers.AutoModelForCausalLM.from_pretrained(project / "models" / "tiny-llama").eval()
    with torch.no_grad():
        assert_merged_logits(merged(**batch).logits, trained(**batch).logits, bare(**batch).logits)


def test_prompt_completion_data_trains_with_raw_prompt_samples(project):
    done = workbench("run", "ft.toml", "--headless", "--set", "training.max_steps=6", "--set", "training.eval_steps=3",
                     "--set", "training.save_steps=6", "--set", 'data.format="prompt-completion"',
                     "--set", 'data.train={path="data/completions.jsonl"}', "--set",
                     'data.eval={path="data/completions.jsonl", split="train[:8]"}',
                     "--set", 'samples.prompts=["2 plus 3 is"]', "--set", "samples.chat=false",
                     "--set", "training.output_dir=runs/completions", cwd=project, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = [e for e in _events(project / "runs" / "completions") if e["event"] == "sample"]
    assert [e["step"] for e in samples] == [0, 3, 6] and samples[0]["prompt"] == "2 plus 3 is"


def test_two_processes_train_the_adapter_and_resume_bitwise(project):
    import shutil

    ranks = ("--num-processes", "2", "--set", "training.max_steps=16", "--set", "training.eval_steps=8",
             "--set", "training.save_steps=8")
    first = workbench("run", "ft.toml", "--headless", *ranks, "--set", "training.output_dir=runs/ddp", cwd=project,
                      timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    out = project / "runs" / "ddp"
    files = {p.name for p in (out / "checkpoint-16").iterdir()}
    assert {"adapter_model.safetensors", "rng_state_0.pth", "rng_state_1.pth"} <= files
    assert "model.safetensors" not in files
    again = project / "runs" / "ddp-resumed"
    shutil.copytree(out / "checkpoint-8", again / "checkpoint-8")
    resumed = workbench("run", "ft.toml", "--headless", *ranks, "--set", "training.output_dir=runs/ddp-resumed",
                        "--resume", cwd=project, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    mine, theirs = (load_file(p / "checkpoint-16" / "adapter_model.safetensors") for p in (again, out))
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
