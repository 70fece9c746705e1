"""Text from a causal LM: the one generation path of workbench.

Two callers share it: the samples a run takes at its evaluations (``samples.py``, the
``[samples]`` table) and ``Session.sample`` on a paused run (session/inspection.py). Both
run it between steps, never inside one, with every random stream preserved by the caller
or here, so a run that samples trains bitwise as one that does not.

It speaks to two kinds of model: transformers' (``GenerationMixin``: a clean
``GenerationConfig`` is passed, so greedy decoding raises none of transformers' warnings
about sampling flags, and the pad and end-of-sequence ids are set) and workbench's own
(``TinyGPT.generate(ids, max_new_tokens, temperature, top_k, generator)``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from workbench.core.rng import rng_preserved
from workbench.core.trainer_utils import unwrap_model
from workbench.models.kinds import model_kind

__all__ = [
    "Generated",
    "encode_prompt",
    "eval_mode",
    "generate_text",
    "generation_problem",
    "uses_chat_template",
]


@dataclass(frozen=True)
class Generated:
    """One answer: its text and how many new tokens it took (the end-of-sequence token included)."""

    answer: str
    tokens: int


def generation_problem(model: Any, tokenizer: Any) -> str | None:
    """Why ``model`` cannot generate text with ``tokenizer`` (one line), or None when it can:
    a causal LM with ``generate()``, and a processing class to turn a prompt into ids and back."""
    model = unwrap_model(model)
    if model is None:
        return "there is no model yet"
    if not hasattr(model, "generate") or model_kind(model) != "ForCausalLM":
        return f"{type(model).__name__} is not a causal LM with generate()"
    if tokenizer is None:
        return "the run has no tokenizer (processing_class) to turn a prompt into ids and back"
    if not callable(tokenizer) or not hasattr(tokenizer, "decode"):
        return f"the processing class {type(tokenizer).__name__} cannot encode and decode text"
    return None


def uses_chat_template(tokenizer: Any, chat: bool | None) -> bool:
    """Whether a prompt goes in as a user message of the tokenizer's chat template: ``chat``
    True or False, or None (auto) for "when the tokenizer has one"."""
    if chat is None:
        return bool(getattr(tokenizer, "chat_template", None))
    return chat


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = False) -> list[int]:
    """The ids of ``prompt``: as it is, or (``chat``) rendered as one user message with the
    assistant's turn opened (``add_generation_prompt``), as a chat model is asked at inference."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat: the tokenizer has no chat_template; set chat = false to send the raw prompt")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        encoded = tokenizer(text, add_special_tokens=False)  # the template writes its own special tokens
    else:
        encoded = tokenizer(prompt)
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded.input_ids
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # a tokenizer that always returns a batch
        ids = ids[0]
    return list(ids)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run a block with ``model`` in eval mode (no dropout), then give every module back the
    mode it had: ``model.train()`` would also switch on modules the user keeps in eval mode."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        # Through train(), never the flag alone: a module may act on the switch (merge or unmerge
        # adapter weights). Pre-order, so a module's call comes before its children's own modes.
        for module, training in modes:
            if module.training != training:
                module.train(training)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    try:
        takes_skip = "skip_special_tokens" in inspect.signature(tokenizer.decode).parameters
    except (TypeError, ValueError):
        takes_skip = False
    # The end-of-sequence and pad tokens are not part of the answer.
    return tokenizer.decode(ids, skip_special_tokens=True) if takes_skip else tokenizer.decode(ids)


def _seeded(device: torch.device, seed: int) -> None:
    """Seed the streams transformers' sampling draws from: the CPU's and this device's only
    (``torch.manual_seed`` would reseed every GPU, which the caller does not restore)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def _transformers_config(model: Any, tokenizer: Any, max_new_tokens: int, temperature: float,
                         top_k: int | None) -> Any:
    """A GenerationConfig that says every flag it means: the model's own defaults (a checkpoint's
    generation_config.json may set temperature or top_p) fill only the fields left unset, and
    transformers warns when a sampling flag meets greedy decoding."""
    from transformers import GenerationConfig

    own = getattr(model, "generation_config", None)
    eos = getattr(own, "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(own, "pad_token_id", None)
    if pad is None:  # transformers would set it itself, with a warning
        pad = eos[0] if isinstance(eos, list) else eos
    sampling = temperature > 0
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sampling,
                            temperature=temperature if sampling else 1.0, top_k=(top_k or 0) if sampling else 50,
                            top_p=1.0, num_beams=1, pad_token_id=pad, eos_token_id=eos)


def generate_text(model: Any, tokenizer: Any, prompt: str, *, max_new_tokens: int, temperature: float = 0.0,
                  top_k: int | None = None, seed: int = 0, chat: bool = False) -> Generated:
    """Generate an answer to ``prompt`` (``temperature`` 0: greedy; else sampled with
    ``top_k`` from ``seed``), with the model in eval mode and every random stream left as it
    was, so a training run around it goes on bitwise as without it. Raises ValueError (one
    line) for a prompt that gives no tokens or does not fit the model's context."""
    model = unwrap_model(model)
    problem = generation_problem(model, tokenizer)
    if problem is not None:
        raise ValueError(f"sample: {problem}")
    ids = encode_prompt(tokenizer, prompt, chat)
    if not ids:
        raise ValueError("sample: the prompt gave no tokens; type some text the tokenizer knows")
    config = getattr(model, "config", None)
    context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and len(ids) + max_new_tokens > context:
        raise ValueError(f"sample: the prompt's {len(ids)} tokens plus max_new_tokens {max_new_tokens} exceed "
                         f"the model's context of {context} tokens; ask for at most {max(context - len(ids), 0)}")
    device = next(model.parameters()).device
    prompt_ids = torch.tensor([ids], dtype=torch.long, device=device)
    with rng_preserved(), eval_mode(model), torch.no_grad():
        if getattr(model, "generation_config", None) is not None:  # transformers' GenerationMixin (or peft's)
            if temperature > 0:
                _seeded(device, seed)
            out = model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                 generation_config=_transformers_config(model, tokenizer, max_new_tokens,
                                                                        temperature, top_k))
        else:
            generator = torch.Generator(device=device).manual_seed(seed)
            out = model.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                 generator=generator)
    new = out[0, len(ids):].tolist()  # one prompt: no padding after an early end
    return Generated(answer=_decode(tokenizer, new), tokens=len(new))
