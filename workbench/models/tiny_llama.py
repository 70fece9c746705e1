"""A local example for the fine-tuning path: a tiny Llama-style model saved with
``save_pretrained``, a byte-level BPE tokenizer trained here with a chat template, and chat
(``messages``) and prompt/completion jsonl files of one small task (sums in words) -- what
a user brings to a LoRA run, with nothing downloaded. ``workbench init --finetune
--example`` writes them next to the config; the tests and benchmarks build them too.

transformers and tokenizers are imported inside the functions (the ``hf`` extra).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Each turn is <|role|>content<|end|>; the assistant's answer ends with <|end|>, the eos
# token, so a model trained on the answers learns to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# Sums of two numbers up to LARGEST: few enough facts for a 0.1 M-parameter model to learn in seconds.
LARGEST = 5
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]


__all__ = ["CHAT_TEMPLATE", "NUMBER_WORDS", "Workspace", "build_chat_tokenizer", "build_tiny_llama", "build_workspace", "chat_rows",
           "completion_rows", "write_jsonl"]


@dataclass(frozen=True)
class Workspace:
    """The paths of a built workspace (all absolute)."""

    root: Path
    model: Path
    chat: Path
    chat_eval: Path
    completions: Path


def _sums(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(0, LARGEST), rng.randint(0, LARGEST)) for _ in range(n)]


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    """Chat rows: a system line on some, a user question, the assistant's answer."""
    rows = []
    for i, (a, b) in enumerate(_sums(n, seed)):
        messages = [{"role": "system", "content": "Answer in words."}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": f"What is {a} plus {b}?"},
                     {"role": "assistant", "content": f"{NUMBER_WORDS[a + b]}."}]
        rows.append({"messages": messages})
    return rows


def completion_rows(n: int, seed: int = 0) -> list[dict]:
    """Prompt/completion rows of the same task."""
    return [{"prompt": f"{a} plus {b} is", "completion": f" {NUMBER_WORDS[a + b]}."} for a, b in _sums(n, seed)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def build_chat_tokenizer(folder: Path, *, chat_template: str | None = CHAT_TEMPLATE, vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on the task's text, saved to ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [m["content"] for r in chat_rows(400, seed=99) for m in r["messages"]]
    texts += [r["prompt"] + r["completion"] for r in completion_rows(200, seed=98)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>", pad_token="<pad>")
    if chat_template is not None:
        fast.chat_template = chat_template
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return fast


def build_tiny_llama(folder: Path, *, vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 64,
                     tokenizer=None, pretrain_steps: int = 0) -> Path:
    """A Llama-style causal LM (about 0.1 M weights) saved with ``save_pretrained``.

    With ``tokenizer`` and ``pretrain_steps``, it is first trained on plain sentences of the
    task ("3 plus 4 is seven."), so it comes as a *pretrained* model does: knowing the
    language, not the chat format, which a LoRA adapter then teaches it in a few hundred
    steps. Seeded: the same arguments give the same weights.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    if tokenizer is not None and pretrain_steps:
        _pretrain(model, tokenizer, pretrain_steps, seed)
    model.save_pretrained(folder)
    return folder


def _pretrain(model, tokenizer, steps: int, seed: int) -> None:
    import torch

    texts = [f"{a} plus {b} is {NUMBER_WORDS[a + b]}." for a in range(LARGEST + 1) for b in range(LARGEST + 1)]
    if getattr(tokenizer, "chat_template", None):
        # Conversations of another task: the model knows the chat format, not this task's in it.
        texts += [tokenizer.apply_chat_template([{"role": "user", "content": f"What comes after {n}?"},
                                                 {"role": "assistant", "content": f"{NUMBER_WORDS[n + 1]}."}],
                                                tokenize=False) for n in range(2 * LARGEST)]
    encoded = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        rows = torch.randint(0, len(texts), (32,), generator=generator)
        loss = model(input_ids=encoded["input_ids"][rows], attention_mask=encoded["attention_mask"][rows],
                     labels=labels[rows]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()


def build_workspace(root: Path, *, rows: int = 64, chat_template: str | None = CHAT_TEMPLATE,
                    pretrain_steps: int = 300) -> Workspace:
    """The model folder (weights and tokenizer together, as on the Hub) and the data files under ``root``."""
    root = Path(root).absolute()
    model = root / "models" / "tiny-llama"
    tokenizer = build_chat_tokenizer(model, chat_template=chat_template)
    build_tiny_llama(model, vocab_size=len(tokenizer), tokenizer=tokenizer, pretrain_steps=pretrain_steps)
    return Workspace(
        root=root, model=model,
        chat=write_jsonl(root / "data" / "chat.jsonl", chat_rows(rows)),
        chat_eval=write_jsonl(root / "data" / "chat_eval.jsonl", chat_rows(max(rows // 4, 4), seed=1)),
        completions=write_jsonl(root / "data" / "completions.jsonl", completion_rows(rows)),
    )
