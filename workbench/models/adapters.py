"""LoRA adapters through ``peft``: build one from a ``[model.peft]`` table, tell an adapter
model from a plain one, and move its trainable state in and out of a checkpoint.

A PEFT run trains a few adapter tensors on top of a frozen base. Its checkpoints hold what
transformers' Trainer writes for such a model (``adapter_model.safetensors`` and
``adapter_config.json``, not the frozen base), and its optimizer state covers the trainable
parameters only, so a checkpoint is a small fraction of a full one. ``peft`` is an optional
extra (``workbench[peft]``) imported inside the functions: importing this module costs
nothing and asks for nothing.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "LORA_KEYS",
    "PEFT_MISSING",
    "adapter_state",
    "apply_lora",
    "is_peft_model",
    "load_adapter_state",
    "lora_keys",
    "module_names_of_folder",
    "parameter_split",
    "unmatched_targets",
]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_MISSING = "needs the peft package: pip install 'workbench[peft]'"
# LoraConfig fields peft fills in itself: a config file never sets them.
_INTERNAL_KEYS = ("peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                  "inference_mode", "runtime_config")
# The task type a model kind's adapter needs (peft wraps the model's forward accordingly).
_TASK_TYPES = {"ForCausalLM": "CAUSAL_LM", "ForSequenceClassification": "SEQ_CLS",
               "ForTokenClassification": "TOKEN_CLS", "ForQuestionAnswering": "QUESTION_ANS",
               "ForConditionalGeneration": "SEQ_2_SEQ_LM", "ForSeq2SeqLM": "SEQ_2_SEQ_LM"}
LORA_KEYS: tuple[str, ...] = ()  # filled by lora_keys() once peft is imported


def lora_keys() -> tuple[str, ...]:
    """The keys a ``[model.peft]`` table may set: ``peft.LoraConfig``'s user-facing fields.

    Raises ImportError (with the install line) when peft is not installed.
    """
    global LORA_KEYS
    if not LORA_KEYS:
        from peft import LoraConfig

        LORA_KEYS = tuple(f.name for f in dataclasses.fields(LoraConfig) if f.init and f.name not in _INTERNAL_KEYS)
    return LORA_KEYS


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a peft ``PeftModel`` (checked without importing peft for others)."""
    if not type(model).__module__.startswith("peft"):
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def task_type_of(architecture: str | None) -> str | None:
    """peft's task type for a transformers architecture name (``LlamaForCausalLM``), or None."""
    for suffix, task in _TASK_TYPES.items():
        if architecture and architecture.endswith(suffix):
            return task
    return "CAUSAL_LM" if architecture and architecture.endswith("LMHeadModel") else None


def apply_lora(model: torch.nn.Module, options: dict[str, Any]) -> torch.nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` with a LoraConfig made of ``options``.

    The task type defaults to the one the model's kind needs, as a user of peft would set
    it (``CAUSAL_LM`` for a causal LM), so the adapter model keeps its forward and loss.
    """
    from peft import LoraConfig, get_peft_model

    options = dict(options)
    architectures = getattr(getattr(model, "config", None), "architectures", None) or [type(model).__name__]
    task = task_type_of(architectures[0])
    if task is not None:
        options.setdefault("task_type", task)
    with warnings.catch_warnings():  # peft asks transformers a deprecated question; not the user's business
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, LoraConfig(**options))


def module_names_of_folder(folder: str | Path) -> list[str] | None:
    """The module names of the model saved in ``folder``, read from its safetensors headers
    (nothing is loaded); None when the folder holds no safetensors weights."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif index.is_file():
        files = [folder / f for f in sorted(set(json.loads(index.read_text("utf-8"))["weight_map"].values()))]
    else:
        return None
    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(key.rsplit(".", 1)[0] for key in f.keys() if "." in key)
    return sorted(names)


def _matches(target: str, module: str) -> bool:
    # peft's rule for a list entry: the whole name, or its last dotted parts.
    return module == target or module.endswith("." + target)


def unmatched_targets(target_modules: Any, module_names: Iterable[str]) -> list[str]:
    """The entries of ``target_modules`` that name no module (peft's matching rules): each
    entry of a list must match some module's name or dotted suffix; a string is a regular
    expression that must match a whole name. ``"all-linear"`` matches by type, not name."""
    names = list(module_names)
    if target_modules is None or target_modules == "all-linear":
        return []
    if isinstance(target_modules, str):
        return [] if any(re.fullmatch(target_modules, n) for n in names) else [target_modules]
    return [t for t in target_modules if not any(_matches(t, n) for n in names)]


def adapter_state(model: torch.nn.Module, copy: bool = True) -> dict[str, torch.Tensor]:
    """The trainable tensors of a PEFT model under their own names (host copies by default):
    what ``PeftModel.save_pretrained(state_dict=...)`` selects the adapter from, without
    copying the frozen base."""
    return {name: p.detach().to("cpu", copy=copy).contiguous() for name, p in model.named_parameters()
            if p.requires_grad}


def load_adapter_state(model: torch.nn.Module, folder: str | Path) -> None:
    """Load ``folder/adapter_model.safetensors`` into the PEFT ``model``'s active adapter.

    Raises ValueError when an adapter tensor of the model is not in the file, or the file
    holds tensors the model has no place for (another adapter's shape or targets).
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_WEIGHTS
    saved = load_file(str(path))
    result = set_peft_model_state_dict(model, saved)
    expected = set(adapter_state(model, copy=False))
    missing = sorted(n for n in result.missing_keys if n in expected)
    unexpected = sorted(result.unexpected_keys)
    if missing or unexpected:
        raise ValueError(f"{folder}: the adapter does not fit this model (missing: {missing[:3]}, "
                         f"unexpected: {unexpected[:3]}); was it trained with another [model.peft]?")


def parameter_split(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts, tied weights counted once."""
    seen: set[int] = set()
    trainable = frozen = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen
