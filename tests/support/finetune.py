"""The fine-tuning workspace of the tests (workbench/models/tiny_llama.py builds it: a tiny
Llama, a chat tokenizer, chat and prompt/completion jsonl), and the LoRA pieces a peft user
builds by hand.
"""

from __future__ import annotations

from pathlib import Path

from workbench.models.tiny_llama import (  # noqa: F401 - the tests' names for them
    CHAT_TEMPLATE,
    NUMBER_WORDS,
    Workspace,
    build_chat_tokenizer,
    build_tiny_llama,
    build_workspace,
    chat_rows,
    completion_rows,
    write_jsonl,
)


def chat_lm_dataset(model_folder: Path, rows: int = 32):
    """The chat rows rendered with the template and tokenized: a plain causal-LM data set
    (every token trained), for tests of adapters that do not need the chat formats."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in chat_rows(rows)]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return datasets.Dataset.from_dict({"input_ids": ids}), tokenizer


def lora_model(model_folder: Path, *, seed: int = 0, r: int = 4, dropout: float = 0.1,
               targets: tuple[str, ...] = ("q_proj", "v_proj")):
    """The pretrained tiny Llama with a fresh LoRA adapter, as a peft user builds it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_folder)
    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=list(targets),
                        task_type="CAUSAL_LM")
    return get_peft_model(base, config)
