"""Batch collation: the collators of the reference (HF semantics) and column removal.

* :func:`default_data_collator`: stack already-equal examples (HF's default).
* :class:`DataCollatorWithPadding`: pad to the longest (or ``max_length``) with an attention mask.
* :class:`DataCollatorForLanguageModeling`: labels from ``input_ids`` (-100 on padding); with
  ``mlm=True`` dynamic masking (80% mask token, 10% random token, 10% unchanged).
* :class:`DataCollatorForSeq2Seq`: pad inputs, pad ``labels`` with -100 to their own longest.
* :class:`DataCollatorForTokenClassification`: pad ``labels`` with -100 to the input length.
* :func:`default_collator_for`: the Trainer's default, chosen from the processing class as HF.
* :class:`RemoveColumnsCollator`: drop what the model's forward does not take (said once).

Padding needs only ``pad_token_id`` (and optionally ``padding_side``) from the tokenizer, so
the built-in :class:`~workbench.data.builtin.CharTokenizer` and any transformers tokenizer work alike;
transformers is never imported here.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "DataCollatorForLanguageModeling",
    "DataCollatorForSeq2Seq",
    "DataCollatorForTokenClassification",
    "DataCollatorWithPadding",
    "RemoveColumnsCollator",
    "default_collator_for",
    "default_data_collator",
    "pad_sequences",
    "signature_columns",
]

log = logging.getLogger("transformers.trainer")  # where HF reports the columns it drops

IGNORE_INDEX = -100
# Keys padded along the sequence, with the value a padded position gets (None: the pad id).
_PAD_VALUES: dict[str, int | None] = {"input_ids": None, "attention_mask": 0, "token_type_ids": 0,
                                      "special_tokens_mask": 1, "position_ids": 0, "labels": IGNORE_INDEX}


def _as_tensor(values: Sequence[Any]) -> torch.Tensor:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(values))
    if isinstance(first, np.ndarray):
        return torch.from_numpy(np.stack(values))
    return torch.tensor(values)


def default_data_collator(features: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Stack a list of dict examples into a batch of tensors.

    As in transformers: a "label" or "label_ids" key becomes "labels" (int labels as long,
    float labels as float); strings and None values are left out of the batch.
    """
    if not features:
        return {}
    if not isinstance(features[0], Mapping):
        # Plain tuples/tensors: let torch do what it does for non-dict datasets.
        return torch.utils.data.default_collate(features)
    first = features[0]
    batch: dict[str, Any] = {}
    label_key = "label" if "label" in first else "label_ids" if "label_ids" in first else None
    if label_key is not None and first[label_key] is not None:
        labels = [f[label_key] for f in features]
        tensor = _as_tensor(labels)
        if not tensor.is_floating_point():
            tensor = tensor.long()
        batch["labels"] = tensor
    for key, value in first.items():
        if key in ("label", "label_ids") or value is None or isinstance(value, str):
            continue
        batch[key] = _as_tensor([f[key] for f in features])
    return batch


# -- padding ---------------------------------------------------------------------------------


def _target_length(longest: int, padding: bool | str, max_length: int | None, multiple: int | None) -> int:
    if padding == "max_length":
        if max_length is None:
            raise ValueError('padding="max_length" needs max_length')
        length = max_length
    else:
        length = longest
    if multiple:
        length = -(-length // multiple) * multiple
    return length


def pad_sequences(sequences: Sequence[Any], length: int, value: int, side: str = "right") -> torch.Tensor:
    """A ``(len(sequences), length)`` long tensor of 1-D ``sequences`` padded with ``value``.

    Sequences longer than ``length`` are an error rather than silently cut: truncation is the
    tokenizer's job (``max_length`` in the data config).
    """
    out = torch.full((len(sequences), length), value, dtype=torch.long)
    for row, seq in enumerate(sequences):
        seq = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
        n = seq.numel()
        if n > length:
            raise ValueError(f"a sequence of {n} tokens does not fit the padded length {length}; "
                             "truncate it (max_length) or raise the padding length")
        if side == "left":
            out[row, length - n:] = seq
        else:
            out[row, :n] = seq
    return out


def _is_sequence(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim == 1
    return isinstance(value, (list, tuple))


def _pad_batch(features: list[Mapping[str, Any]], tokenizer: Any, padding: bool | str,
               max_length: int | None, multiple: int | None, skip: Sequence[str] = ()) -> dict[str, Any]:
    """Pad the token-aligned keys of ``features`` to one length; stack the rest (HF ``pad``).

    Always returns an ``attention_mask`` (1 = real token) when ``input_ids`` are present, as
    a transformers tokenizer's ``pad`` does.
    """
    first = features[0]
    side = getattr(tokenizer, "padding_side", "right") or "right"
    pad_id = getattr(tokenizer, "pad_token_id", None)
    batch: dict[str, Any] = {}
    ragged = {k for k, v in first.items() if k in _PAD_VALUES and k not in skip and _is_sequence(v)}
    if padding is False or padding == "do_not_pad":
        ragged = set()
    lengths = [len(f["input_ids"]) for f in features] if "input_ids" in first else None
    longest = max((len(f[k]) for k in ragged for f in features), default=0)
    length = _target_length(longest, padding, max_length, multiple)
    if ragged and pad_id is None and "input_ids" in ragged and any(n != length for n in lengths or ()):
        raise ValueError(
            "the tokenizer has no pad token, so variable-length input_ids cannot be padded; set one "
            "(e.g. tokenizer.pad_token = tokenizer.eos_token) or make all sequences equally long"
        )
    for key in ragged:
        value = _PAD_VALUES[key]
        batch[key] = pad_sequences([f[key] for f in features], length, pad_id if value is None else value, side)
    if lengths is not None and "attention_mask" not in first:
        mask = [torch.ones(n, dtype=torch.long) for n in lengths]
        batch["attention_mask"] = (pad_sequences(mask, length, 0, side) if "input_ids" in ragged
                                   else torch.stack(mask))
    for key, value in first.items():
        if key in batch or key in skip or value is None or isinstance(value, str):
            continue
        values = [f[key] for f in features]
        try:
            batch[key] = _as_tensor(values)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"cannot batch column {key!r}: its values differ in shape ({exc}); "
                             "remove it or pad it yourself") from None
    return batch


def _rename_label(features: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    first = features[0]
    for key in ("label", "label_ids"):
        if key in first and "labels" not in first:
            return [{("labels" if k == key else k): v for k, v in f.items()} for f in features]
    return features


@dataclass
class DataCollatorWithPadding:
    """Pad token-aligned keys (``input_ids``, ``attention_mask``, ...) to one length.

    HF semantics: ``padding`` True/"longest" pads to the longest example, "max_length" to
    ``max_length``, False not at all; ``pad_to_multiple_of`` rounds the length up (tensor
    cores like multiples of 8). An ``attention_mask`` is always returned. "label"/"label_ids"
    become "labels"; sequence labels are padded with -100. A processing class without a
    ``pad_token_id`` but with a ``pad`` method (a feature extractor) does the padding itself.
    """

    tokenizer: Any
    padding: bool | str = True
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, Any]:
        if not features:
            return {}
        features = _rename_label(features)
        if not hasattr(self.tokenizer, "pad_token_id") and callable(getattr(self.tokenizer, "pad", None)):
            return dict(self.tokenizer.pad(features, padding=self.padding, max_length=self.max_length,
                                           pad_to_multiple_of=self.pad_to_multiple_of, return_tensors="pt"))
        batch = _pad_batch(features, self.tokenizer, self.padding, self.max_length, self.pad_to_multiple_of)
        if "labels" in batch and not batch["labels"].is_floating_point():
            batch["labels"] = batch["labels"].long()
        return batch


def _mask_generator(seed: int, epoch: int, ids: torch.Tensor) -> torch.Generator:
    # A pure function of (seed, epoch, the batch's tokens): the same batch is masked the same
    # way after a resume, in any worker, whatever was drawn before it.
    digest = hashlib.blake2b(ids.numpy().tobytes(), digest_size=8, key=f"{seed}:{epoch}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF)


@dataclass
class DataCollatorForLanguageModeling:
    """Batches for language modeling: causal (``mlm=False``) or masked (``mlm=True``).

    Causal: ``labels`` are the padded ``input_ids`` with -100 on padding (examples that bring
    their own ``labels``, such as packed blocks, keep them, padded with -100). The model
    shifts them.

    Masked (dynamic masking, re-drawn every time a batch is built): each non-special,
    non-padding token is selected with ``mlm_probability``; labels are -100 elsewhere; of the
    selected tokens ``mask_replace_prob`` become the mask token, ``random_replace_prob`` a
    random token, the rest stay. With ``seed`` set, the draw is a pure function of
    ``(seed, epoch, the batch's tokens)`` so a resumed run masks exactly as an uninterrupted
    one, with or without dataloader workers (the Trainer calls ``set_epoch``); without it
    torch's global RNG is used (as HF; exact on resume only with ``dataloader_num_workers=0``).
    """

    tokenizer: Any
    mlm: bool = True
    mlm_probability: float = 0.15
    mask_replace_prob: float = 0.8
    random_replace_prob: float = 0.1
    pad_to_multiple_of: int | None = None
    seed: int | None = None
    return_tensors: str = "pt"

    def __post_init__(self) -> None:
        self.epoch = 0
        if not 0 <= self.mlm_probability <= 1:
            raise ValueError(f"mlm_probability must be in [0, 1], got {self.mlm_probability}")
        if self.mask_replace_prob + self.random_replace_prob > 1:
            raise ValueError("mask_replace_prob + random_replace_prob must be <= 1")
        if self.mlm and getattr(self.tokenizer, "mask_token_id", None) is None:
            raise ValueError("masked language modeling needs a tokenizer with a mask token "
                             "(mask_token_id); use mlm=False for causal language modeling")

    def set_epoch(self, epoch: int) -> None:
        """Epoch number that salts the seeded masking (so each epoch masks afresh)."""
        self.epoch = epoch

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, Any]:
        if not features:
            return {}
        has_labels = "labels" in features[0] and _is_sequence(features[0]["labels"])
        batch = _pad_batch(features, self.tokenizer, True, None, self.pad_to_multiple_of)
        special = batch.pop("special_tokens_mask", None)
        if self.mlm:
            batch["input_ids"], batch["labels"] = self.mask_tokens(batch["input_ids"], batch["attention_mask"], special)
        elif not has_labels:
            labels = batch["input_ids"].clone()
            labels[batch["attention_mask"] == 0] = IGNORE_INDEX
            batch["labels"] = labels
        return batch

    def mask_tokens(self, inputs: torch.Tensor, attention_mask: torch.Tensor,
                    special_tokens_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked inputs and their labels (-100 where nothing was masked)."""
        generator = _mask_generator(self.seed, self.epoch, inputs) if self.seed is not None else None
        labels = inputs.clone()
        probability = torch.full(labels.shape, self.mlm_probability)
        blocked = attention_mask == 0
        if special_tokens_mask is not None:
            blocked |= special_tokens_mask.bool()
        special_ids = [i for i in (getattr(self.tokenizer, "all_special_ids", None) or []) if i is not None]
        if special_ids:
            blocked |= torch.isin(inputs, torch.tensor(special_ids))
        probability.masked_fill_(blocked, 0.0)
        selected = torch.bernoulli(probability, generator=generator).bool()
        labels[~selected] = IGNORE_INDEX
        inputs = inputs.clone()
        draw = torch.rand(labels.shape, generator=generator)
        to_mask = selected & (draw < self.mask_replace_prob)
        to_random = selected & ~to_mask & (draw < self.mask_replace_prob + self.random_replace_prob)
        inputs[to_mask] = self.tokenizer.mask_token_id
        vocab = len(self.tokenizer) if hasattr(self.tokenizer, "__len__") else self.tokenizer.vocab_size
        random_ids = torch.randint(vocab, labels.shape, dtype=torch.long, generator=generator)
        inputs[to_random] = random_ids[to_random]
        return inputs, labels


def _pad_inputs(collator: Any, features: list[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], dict[str, Any]]:
    """(features with "label" renamed, the padded batch of everything but the labels), for the
    collators that pad labels their own way."""
    features = _rename_label(features)
    return features, _pad_batch(features, collator.tokenizer, collator.padding, collator.max_length,
                                collator.pad_to_multiple_of, skip=("labels",))


@dataclass
class DataCollatorForSeq2Seq:
    """Encoder-decoder batches: inputs padded as usual, ``labels`` padded with -100 to their own
    longest length (rounded to ``pad_to_multiple_of``); with a ``model`` that has
    ``prepare_decoder_input_ids_from_labels`` the ``decoder_input_ids`` are built too."""

    tokenizer: Any
    model: Any = None
    padding: bool | str = True
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    label_pad_token_id: int = IGNORE_INDEX
    return_tensors: str = "pt"

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, Any]:
        if not features:
            return {}
        features, batch = _pad_inputs(self, features)
        if "labels" in features[0] and features[0]["labels"] is not None:
            labels = [f["labels"] for f in features]
            if _is_sequence(labels[0]):
                longest = max(len(x) for x in labels)
                length = _target_length(longest, True, None, self.pad_to_multiple_of)
                side = getattr(self.tokenizer, "padding_side", "right") or "right"
                batch["labels"] = pad_sequences(labels, length, self.label_pad_token_id, side)
            else:
                batch["labels"] = _as_tensor(labels).long()
            prepare = getattr(self.model, "prepare_decoder_input_ids_from_labels", None)
            if callable(prepare) and "decoder_input_ids" not in batch:
                batch["decoder_input_ids"] = prepare(labels=batch["labels"])
        return batch


@dataclass
class DataCollatorForTokenClassification:
    """Token classification: inputs padded, per-token ``labels`` padded with -100 to the same
    length (on the tokenizer's padding side) so each label stays aligned with its token."""

    tokenizer: Any
    padding: bool | str = True
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    label_pad_token_id: int = IGNORE_INDEX
    return_tensors: str = "pt"

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, Any]:
        if not features:
            return {}
        features, batch = _pad_inputs(self, features)
        if "labels" in features[0]:
            length = batch["input_ids"].shape[1]
            side = getattr(self.tokenizer, "padding_side", "right") or "right"
            batch["labels"] = pad_sequences([f["labels"] for f in features], length, self.label_pad_token_id, side)
        return batch


def _is_tokenizer_like(processing_class: Any) -> bool:
    names = {c.__name__ for c in type(processing_class).__mro__}
    if names & {"PreTrainedTokenizerBase", "SequenceFeatureExtractor", "TokenizersBackend"}:
        return True
    return hasattr(processing_class, "pad_token_id") and callable(processing_class)


def default_collator_for(processing_class: Any) -> Callable:
    """The collator a Trainer uses when none is given, chosen as HF does.

    A tokenizer (a transformers tokenizer, a sequence feature extractor, or anything with a
    ``pad_token_id`` that is called on text, such as the built-in CharTokenizer) gives
    :class:`DataCollatorWithPadding`; anything else, or none, :func:`default_data_collator`.
    """
    if processing_class is not None and _is_tokenizer_like(processing_class):
        return DataCollatorWithPadding(processing_class)
    return default_data_collator


# -- column removal --------------------------------------------------------------------------


def signature_columns(model: torch.nn.Module, label_names: Sequence[str] = ()) -> set[str]:
    """Columns the model's forward takes by name, plus the label columns (HF's rule).

    As in HF, a ``**kwargs`` parameter does not make every column welcome: only named
    parameters count (set ``remove_unused_columns=False`` to pass everything through).
    """
    forward = getattr(model, "forward", model)
    params = inspect.signature(forward).parameters
    named = {name for name, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return named | {"label", "label_ids", "labels", *label_names}


class RemoveColumnsCollator:
    """Drops example keys the model's forward does not accept, then collates.

    The dropped names are reported once (per ``reported`` set, which a Trainer shares between
    its loaders), so a user learns why a column vanished without a message every evaluation.
    """

    def __init__(self, collator: Callable, keep: set[str], description: str = "training",
                 reported: set | None = None, quiet: Sequence[str] = ()) -> None:
        self.collator = collator
        self.keep = keep
        self.description = description
        self.reported = reported if reported is not None else set()
        self.quiet = set(quiet)  # dropped without a word (the length column the samplers read)

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on to a collator that uses it (seeded MLM masking)."""
        if hasattr(self.collator, "set_epoch"):
            self.collator.set_epoch(epoch)

    def __call__(self, features: list[Any]) -> Any:
        if features and isinstance(features[0], Mapping):
            dropped = set(features[0]) - self.keep
            if dropped:
                key = (self.description, frozenset(dropped))
                if key not in self.reported and dropped - self.quiet:
                    self.reported.add(key)
                    log.warning(
                        "%s: dropping columns the model's forward does not accept: %s "
                        "(set remove_unused_columns=False to keep them)",
                        self.description, ", ".join(sorted(dropped - self.quiet)),
                    )
                features = [{k: v for k, v in f.items() if k in self.keep} for f in features]
        return self.collator(features)
