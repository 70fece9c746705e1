"""Data for the workbench: built-in demo data sets that need no download.

Sections:

* Character tokenizer: a fixed vocabulary, so the demo model's ids mean the same thing on
  every machine and no tokenizer file has to be shipped.
* Built-in text: the Python standard library's own source, present wherever Python is.
* Datasets: fixed-length token blocks and a synthetic classification task.
* Registry: ``load_builtin_data`` and friends, used by the CLI and the demo.

``datasets`` is deliberately not imported here at module level: start-up speed matters for
the CLI and the built-ins do not need it.
"""

from __future__ import annotations

import functools
import inspect
import os
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "BUILTIN_DATA",
    "CharTokenizer",
    "TensorDictDataset",
    "TokenBlockDataset",
    "builtin_tokenizer",
    "load_builtin_data",
    "python_source_text",
]


# =====================================================================================
# Character tokenizer
# =====================================================================================

_PAD = "<pad>"
_UNK = "<unk>"
# Shown for ids that have no character (unknown characters, ids past the vocabulary that an
# untrained model with a larger embedding may sample); U+FFFD is Unicode's own marker for that.
_REPLACEMENT_CHAR = "\ufffd"


class CharTokenizer:
    """A deterministic character-level tokenizer over ASCII text.

    Ids: 0 = ``<pad>``, 1 = ``<unk>``, then ``"\\n"``, ``"\\t"`` and printable ASCII 32..126.
    Any other character encodes to ``<unk>``. Encoding goes through a numpy lookup table
    rather than a per-character Python loop, so millions of characters take milliseconds.
    """

    pad_token_id: int = 0
    unk_token_id: int = 1

    def __init__(self) -> None:
        chars = ["\n", "\t"] + [chr(c) for c in range(32, 127)]
        self.tokens: tuple[str, ...] = (_PAD, _UNK, *chars)
        # Indexed by code point (< 128); everything else is handled as unknown in encode.
        table = np.full(128, self.unk_token_id, dtype=np.uint8)
        for token_id, ch in enumerate(chars, start=2):
            table[ord(ch)] = token_id
        self._table = table
        self._id_to_char = [_REPLACEMENT_CHAR, _REPLACEMENT_CHAR, *chars]

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (99)."""
        return len(self.tokens)

    def encode_array(self, text: str) -> np.ndarray:
        """Ids of ``text`` as a uint8 numpy array: the fast path for large texts."""
        code_points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        # Entry 127 (DEL) is unk, so clamping folds every non-ASCII character onto unk too.
        return self._table[np.minimum(code_points, 127)]

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, one per character; characters outside the vocabulary become unk."""
        return self.encode_array(text).tolist()

    def decode(self, ids: Iterable[int] | torch.Tensor | np.ndarray) -> str:
        """Text for ``ids``; pad ids are skipped, unknown and out-of-range ids show as U+FFFD."""
        if isinstance(ids, (torch.Tensor, np.ndarray)):
            ids = ids.tolist()
        table = self._id_to_char
        size = len(table)
        return "".join(
            table[i] if 0 <= i < size else _REPLACEMENT_CHAR
            for i in ids
            if i != self.pad_token_id
        )

    def __call__(self, text: str | Sequence[str]) -> dict[str, list[int] | list[list[int]]]:
        """``{"input_ids": ids}`` like a Hugging Face tokenizer; a list of texts gives a list of lists."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text)}
        return {"input_ids": [self.encode(t) for t in text]}

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# =====================================================================================
# Built-in text
# =====================================================================================


def _stdlib_dir() -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if any(stdlib.glob("*.py")):
        return stdlib
    # Some relocated or embedded installs report a stdlib path without sources.
    return Path(os.__file__).parent


@functools.lru_cache(maxsize=8)
def python_source_text(max_chars: int = 2_000_000) -> str:
    """The standard library's top-level ``.py`` modules, concatenated, up to ``max_chars``.

    A sizeable, realistic text corpus that exists on every machine with Python, so the demo
    can train a language model offline. Only top-level modules are read (no packages, hence
    no tests, site-packages, idlelib, lib2to3 or turtledemo), in file-name order, each
    preceded by ``"\\n# file: NAME\\n"``; deterministic for a given Python install.
    Cached per process because tests build it many times.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    files = sorted(
        (p for p in _stdlib_dir().glob("*.py")
         # Generated at build time (paths, compiler flags): configuration, not source code.
         if not p.name.startswith("_sysconfigdata")),
        key=lambda p: p.name,
    )
    if not files:
        raise RuntimeError(f"no Python standard library sources found under {_stdlib_dir()}")
    parts: list[str] = []
    total = 0
    for path in files:
        # Reading stops as soon as enough text is collected: the full set is ~5 MB.
        chunk = f"\n# file: {path.name}\n" + path.read_text(encoding="utf-8", errors="replace")
        parts.append(chunk)
        total += len(chunk)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


@functools.lru_cache(maxsize=8)
def _python_source_ids(max_chars: int) -> np.ndarray:
    ids = CharTokenizer().encode_array(python_source_text(max_chars))
    # Shared between callers through the cache, so nobody may change it in place.
    ids.setflags(write=False)
    return ids


# =====================================================================================
# Datasets
# =====================================================================================


class TokenBlockDataset(Dataset):
    """Non-overlapping ``block_size`` windows of one token stream, for causal LM training.

    Item ``i`` is ``{"input_ids": ids[i*B:(i+1)*B], "labels": the same ids}``; the model
    shifts labels itself. A trailing partial block is dropped so every batch is rectangular.
    Items are fresh tensors, so a collator that edits labels in place cannot corrupt the data.
    """

    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        if ids.dim() != 1:
            raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.ids = ids.long()
        self.block_size = block_size

    def __len__(self) -> int:
        return self.ids.numel() // self.block_size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"block {index} out of range for {n} blocks")
        start = index * self.block_size
        block = self.ids[start:start + self.block_size].clone()
        return {"input_ids": block, "labels": block.clone()}


class TensorDictDataset(Dataset):
    """Rows of equally long tensors, returned as dicts: ``{key: tensor[i]}``."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        lengths = {len(t) for t in tensors.values()}
        if len(lengths) != 1:
            raise ValueError(f"all tensors need the same first dimension, got {sorted(lengths)}")
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: t[index] for key, t in self.tensors.items()}


# =====================================================================================
# Registry of built-in data
# =====================================================================================


def _load_python_source(
    *, block_size: int = 128, max_chars: int = 2_000_000, eval_fraction: float = 0.05, seed: int = 0
) -> tuple[TokenBlockDataset, TokenBlockDataset]:
    # seed is part of the shared signature only: the split is contiguous (train text first,
    # eval text last) so evaluation measures text the model has never seen.
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    ids = torch.from_numpy(_python_source_ids(max_chars).astype(np.int64))
    n_train = int(round(ids.numel() * (1.0 - eval_fraction)))
    train = TokenBlockDataset(ids[:n_train], block_size)
    eval_ = TokenBlockDataset(ids[n_train:], block_size)
    if len(train) == 0 or len(eval_) == 0:
        raise ValueError(
            f"python-source with max_chars={max_chars}, eval_fraction={eval_fraction} and "
            f"block_size={block_size} leaves {len(train)} train / {len(eval_)} eval blocks; "
            "raise max_chars or lower block_size"
        )
    return train, eval_


def _load_random_classification(
    *,
    n_train: int = 2048,
    n_eval: int = 256,
    in_features: int = 32,
    num_classes: int = 4,
    seed: int = 0,
) -> tuple[TensorDictDataset, TensorDictDataset]:
    # Labels come from a fixed random linear map, so the task is learnable (linearly
    # separable) yet not trivial; train and eval are drawn i.i.d. from the same generator.
    for name, value in (("n_train", n_train), ("n_eval", n_eval),
                        ("in_features", in_features), ("num_classes", num_classes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(in_features, num_classes, generator=gen)
    x = torch.randn(n_train + n_eval, in_features, generator=gen)
    labels = (x @ weight).argmax(dim=-1)
    train = TensorDictDataset(x=x[:n_train], labels=labels[:n_train])
    eval_ = TensorDictDataset(x=x[n_train:], labels=labels[n_train:])
    return train, eval_


BUILTIN_DATA: dict[str, Callable[..., tuple[Dataset, Dataset]]] = {
    "python-source": _load_python_source,
    "random-classification": _load_random_classification,
}

# Keyword arguments every loader is offered; each takes the ones it has a parameter for.
_COMMON_OPTIONS = ("block_size", "max_chars", "eval_fraction", "seed")


def load_builtin_data(
    name: str,
    *,
    block_size: int = 128,
    max_chars: int = 2_000_000,
    eval_fraction: float = 0.05,
    seed: int = 0,
    **options: Any,
) -> tuple[Dataset, Dataset]:
    """``(train_dataset, eval_dataset)`` for a built-in data set that needs no download.

    * ``"python-source"``: the standard library's source (see :func:`python_source_text`),
      char-tokenized and cut into ``block_size`` blocks for causal LM training; the last
      ``eval_fraction`` of the token stream is the eval split.
    * ``"random-classification"``: a synthetic classification task for the MLP; extra
      options ``n_train``, ``n_eval``, ``in_features``, ``num_classes``; ``seed`` picks it.

    Loader-specific options go in ``options``; unknown names or options raise ``ValueError``
    listing the valid ones, since these come from config files and command lines.
    """
    try:
        loader = BUILTIN_DATA[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown builtin data {name!r}; choose one of: {', '.join(sorted(BUILTIN_DATA))}"
        ) from None
    accepted = list(inspect.signature(loader).parameters)
    extra = sorted(k for k in options if k not in accepted)
    if extra:
        specific = [k for k in accepted if k not in _COMMON_OPTIONS]
        raise ValueError(
            f"unknown option(s) for builtin data {name!r}: {', '.join(extra)}; accepted options: "
            f"{', '.join(list(_COMMON_OPTIONS) + specific)}"
        )
    common = {"block_size": block_size, "max_chars": max_chars, "eval_fraction": eval_fraction, "seed": seed}
    kwargs = {k: v for k, v in common.items() if k in accepted}
    return loader(**kwargs, **options)


def builtin_tokenizer(name: str) -> CharTokenizer | None:
    """The tokenizer that decodes built-in data ``name`` (for showing samples), or None.

    Only ``"python-source"`` is text; other names have no tokenizer.
    """
    return CharTokenizer() if name == "python-source" else None
