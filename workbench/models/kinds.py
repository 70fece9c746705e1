"""What kind of model a run trains, and whether its own loss takes ``num_items_in_batch``,
decided as transformers decides, without importing transformers unless the model is one of
its objects.

The kind is a key of ``losses.LOSS_MAPPING`` ("ForCausalLM", "ForMaskedLM", ...): it picks
the default loss and how targets are counted for ``num_items_in_batch`` (a causal LM's
labels are shifted, so its first position is never a target). transformers names a model's
loss after its class (``PreTrainedModel.loss_type``: the first of its loss-mapping names
found in the class name); a class whose name carries none (``GPT2LMHeadModel``,
``BertLMHeadModel``) is still listed in its auto-model tables, which its Trainer reads to
decide that a model is a causal LM (label smoothing shifts the labels then).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

__all__ = ["KINDS", "ignores_item_count", "loss_uses_item_count", "model_kind", "transformers_forward"]

# The kinds workbench has a default loss for (losses.LOSS_MAPPING has one entry per name).
KINDS = (
    "ForCausalLM",
    "ForMaskedLM",
    "ForTokenClassification",
    "ForSequenceClassification",
    "ForImageClassification",
    "ForAudioClassification",
    "ForVideoClassification",
    "ForMultipleChoice",
)

# transformers' auto-model tables (models/auto/modeling_auto.py) and the kind of their models.
_AUTO_TABLES = (
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "ForCausalLM"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "ForMaskedLM"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "ForTokenClassification"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "ForSequenceClassification"),
    ("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES", "ForMultipleChoice"),
)

# config.problem_type values transformers' classifiers read.
_CLASSIFIER_PROBLEMS = ("regression", "single_label_classification", "multi_label_classification")


def _from_transformers(obj: Any) -> bool:
    return type(obj).__module__.startswith("transformers.")


def _transformers_classes(model: Any) -> list[type]:
    return [c for c in type(model).__mro__ if c.__module__.startswith("transformers.")]


def _kind_in_name(name: str) -> str | None:
    """The loss-mapping name found first in ``name`` (transformers' rule for ``loss_type``)."""
    found = [(name.find(key), key) for key in KINDS if key in name]
    return min(found)[1] if found else None


def _auto_table_kind(names: list[str]) -> str | None:
    """The kind of the first of ``names`` listed in transformers' auto-model tables."""
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:  # an object of an older or partial install: no tables to read
        return None
    for table, kind in _AUTO_TABLES:
        listed: set[str] = set()
        for value in getattr(modeling_auto, table, {}).values():
            listed.update(value if isinstance(value, (list, tuple)) else (value,))
        if any(name in listed for name in names):
            return kind
    return None


def model_kind(model: Any) -> str | None:
    """The model's loss kind (a ``losses.LOSS_MAPPING`` key, or transformers' ``loss_type``
    when workbench has no default loss for it), or None when nothing names one.

    In order: ``model.loss_type`` (transformers sets it from the class name;
    "ForConditionalGeneration" is trained with the causal-LM loss unless the model is an
    encoder-decoder); a loss-mapping name in the class name or a base class's (a subclass of
    ``LlamaForCausalLM`` is a causal LM too) or in ``config.architectures``; transformers'
    auto-model tables, for its models whose names carry no such name (``GPT2LMHeadModel``);
    a classifier's ``config.problem_type``.
    """
    config = getattr(model, "config", None)
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    kind = getattr(model, "loss_type", None)
    if isinstance(kind, str) and kind:
        if kind == "ForConditionalGeneration" and not get("is_encoder_decoder", False):
            return "ForCausalLM"  # transformers maps it to its causal-LM loss (labels shifted)
        return kind
    names = [c.__name__ for c in type(model).__mro__ if c is not object]
    architectures = get("architectures", None) or []
    names += [a for a in architectures if isinstance(a, str)]
    for name in names:
        kind = _kind_in_name(name)
        if kind is not None:
            return kind
    if "transformers" in sys.modules and (_transformers_classes(model) or _from_transformers(config)):
        kind = _auto_table_kind(names)
        if kind is not None:
            return kind
    if get("problem_type", None) in _CLASSIFIER_PROBLEMS:
        return "ForSequenceClassification"
    return None


def transformers_forward(model: Any) -> bool:
    """Whether the model's forward is transformers' own code (not a user's override)."""
    forward = inspect.unwrap(type(model).forward)
    return getattr(forward, "__module__", "").startswith("transformers.") and hasattr(forward, "__code__")


def ignores_item_count(model: Any) -> bool:
    """Whether the model is transformers' own code computing its kind's plain mean loss, which
    ignores ``num_items_in_batch`` (BERT's heads: a ``CrossEntropyLoss`` mean).

    transformers' Trainer passes such a model the count anyway (its forward takes
    ``**kwargs``) and then divides by nothing, so k accumulated micro-batches give k times the
    loss and gradient; workbench computes the loss from the logits with the model's kind's
    loss over the whole accumulated batch instead. A user's own forward is never replaced (it
    may compute something else than its kind's loss)."""
    return transformers_forward(model) and not loss_uses_item_count(model)


def loss_uses_item_count(model: Any) -> bool:
    """Whether the loss the model computes itself (given labels) is divided by a
    ``num_items_in_batch`` passed to its forward, so k accumulated micro-batches sum to the
    loss of one k-times-larger batch.

    ``accepts_loss_kwargs`` (transformers' own flag, where a model sets it) decides first. A
    forward that transformers wrote honours the count when it goes through the model's
    ``loss_function`` (``GPT2LMHeadModel``, ``LlamaForCausalLM``); BERT's heads compute a
    ``CrossEntropyLoss`` mean and ignore it, although their forward takes ``**kwargs``. Any
    other forward is taken at its signature, as transformers' Trainer does: an explicit
    ``num_items_in_batch`` parameter or ``**kwargs``.
    """
    flag = getattr(model, "accepts_loss_kwargs", None)
    if isinstance(flag, bool):
        return flag
    if transformers_forward(model):
        return "loss_function" in inspect.unwrap(type(model).forward).__code__.co_names
    params = inspect.signature(model.forward).parameters
    return "num_items_in_batch" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
