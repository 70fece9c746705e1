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


# A float32 merge rounds W + s*B@A once where the adapter model adds x@W and s*(x@A)@B: through
# the tiny Llama's layers that moves logits of magnitude ~5 by up to ~1e-4 (5.4e-5 seen), so
# 1e-5 failed now and then on the same code. What the adapter learned moves them far more.
MERGE_ATOL = 2e-4


def assert_merged_logits(merged, trained, base) -> None:
    """The merged model's logits equal the adapter model's within a float32 merge, and the
    adapter's own effect (``trained`` against the bare ``base``) is far beyond that tolerance,
    so an export that dropped or mis-scaled the adapter cannot pass."""
    import torch

    torch.testing.assert_close(merged, trained, rtol=0, atol=MERGE_ATOL)
    assert (base - trained).abs().max() > 50 * MERGE_ATOL, "the adapter changed the logits too little to test"
