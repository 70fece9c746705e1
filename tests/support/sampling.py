"""Runs that sample as they train: the tiny Llama of the fine-tuning workspace
(support/finetune.py: a real transformers causal LM with a BPE tokenizer and a chat
template) on its prompt/completion text, and the events a run's samples leave."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from workbench import Trainer, TrainingArguments
from workbench.core.event_file import read_events

from support.finetune import Workspace, completion_rows

PROMPTS = ["What is 2 plus 3?", "What is 4 plus 4?"]


def llama_trainer(ws: Workspace, out: Path, *, callbacks: Any = (), attention_dropout: float = 0.1,
                  generation_defaults: dict | None = None, **overrides: Any) -> Trainer:
    """12 steps of the workspace's tiny Llama (attention dropout on, so a random stream taken
    from training changes its losses) on the sums as text, evaluated at the start and every 4
    steps. ``generation_defaults`` are set on the model's generation_config, as a checkpoint's
    generation_config.json sets them."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from workbench.data.collators import DataCollatorForLanguageModeling

    tok = AutoTokenizer.from_pretrained(ws.model)
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(ws.model, attention_dropout=attention_dropout)
    for key, value in (generation_defaults or {}).items():
        setattr(model.generation_config, key, value)
    rows = [{"input_ids": tok(r["prompt"] + r["completion"])["input_ids"]} for r in completion_rows(96)]
    options = {"max_steps": 12, "per_device_train_batch_size": 8, "per_device_eval_batch_size": 16,
               "learning_rate": 5e-3, "logging_steps": 1, "eval_strategy": "steps", "eval_steps": 4,
               "eval_on_start": True, "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "seed": 7}
    options.update(overrides)
    return Trainer(model=model, args=TrainingArguments(str(out), **options), train_dataset=rows[:80],
                   eval_dataset=rows[80:], processing_class=tok,
                   data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=list(callbacks))


def losses(trainer: Trainer) -> list[tuple[int, str, float]]:
    """Every train and eval loss the run logged, with its step."""
    return [(row["step"], key, row[key]) for row in trainer.state.log_history for key in ("loss", "eval_loss")
            if key in row]


def sample_records(out: Path) -> list[dict]:
    """The ``sample`` records of a run's events.jsonl, in order."""
    return [r for r in read_events(out) if r["event"] == "sample"]


ABOUT_GENERATION = ("generat", "do_sample", "temperature", "top_p", "pad_token", "attention mask")


@contextlib.contextmanager
def no_generation_warnings(trainer: Trainer, prompt: str):
    """Fails unless what runs inside says nothing about generation: not on transformers'
    loggers, not as a Python warning. First it proves the capture hears one (a plain greedy
    generate on a model whose defaults sample warns "generation flags are not valid")."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    from workbench.train.generation import encode_prompt

    heard: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: heard.append(record.getMessage())
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    try:
        hf_logging.warning_once.cache_clear()  # said once a process: the test must hear it anew
        ids = torch.tensor([encode_prompt(trainer.processing_class, prompt)])
        trainer.model.generate(ids, max_new_tokens=2, do_sample=False, temperature=0.6)
        assert any("generation flags are not valid" in m for m in heard), heard  # the capture works
        heard.clear()
        hf_logging.warning_once.cache_clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        library.removeHandler(handler)
    assert heard == []
    assert [str(w.message) for w in caught if any(word in str(w.message) for word in ABOUT_GENERATION)] == []
