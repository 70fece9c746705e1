"""The ``[data]`` table checked: builtin data sets, ``datasets.load_dataset`` tables with local
paths made absolute, and the keys that prepare text (renames, tokenizing, packing).

A mixin of the config loader (``loader._Loader``): its methods use the loader's ``error``,
``table``, ``string``, ``path``, ``builtin_name`` and ``options``, so every problem is one
line that names the file, the line and the key.
"""

from __future__ import annotations

import copy
import difflib
import glob
import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from workbench.config.errors import Key
from workbench.config.toml_lines import kind_of, toml_repr
from workbench.data.chat import FORMATS

__all__ = ["DATA_FORMATS", "DATA_KEYS", "DataSpec", "DataTableChecks", "optional_registry"]

DATA_KEYS = ("builtin", "options", "train", "eval", "columns", "text_column", "format", "completion_only_loss",
             "tokenizer", "max_length", "packing")
# [data] keys that prepare datasets-library data; builtin data sets bring their own.
_PROCESSING_KEYS = ("columns", "text_column", "format", "completion_only_loss", "tokenizer", "max_length", "packing")
# The row formats of ``format``, as workbench/data/chat.py (which prepares them) names them.
DATA_FORMATS = FORMATS
# A data path ending like this is a local file, never a Hub data set name.
_DATA_FILE_EXTENSIONS = (".json", ".jsonl", ".csv", ".tsv", ".txt", ".parquet", ".arrow")

@dataclass(frozen=True)
class DataSpec:
    """Which data to train on: a builtin data set, or ``datasets.load_dataset`` arguments.

    ``train``/``eval`` are keyword-argument tables for ``datasets.load_dataset``, with local
    paths made absolute; ``eval`` is one table or ``{name: table}`` for several eval sets.
    ``columns`` renames columns ``{old: new}``; ``text_column`` is tokenized with
    ``tokenizer`` ("char" or an absolute tokenizer folder; None: the default, see
    workbench.data.datasets_io.run_tokenizer), truncated to ``max_length`` tokens, or with
    ``packing`` cut into ``max_length``-token blocks. ``format`` ("messages": chat rows rendered
    with the tokenizer's chat template; "prompt-completion": text pairs) replaces
    ``text_column``; with ``completion_only_loss`` only the assistant's answers (the
    completions) are trained, see workbench/data/chat.py.
    """

    builtin: str | None = None
    options: dict = field(default_factory=dict)
    train: dict | None = None
    eval: dict | None = None
    columns: dict = field(default_factory=dict)
    text_column: str | None = None
    tokenizer: str | None = None
    max_length: int | None = None
    packing: bool = False
    format: str | None = None
    completion_only_loss: bool = True


def optional_registry(module: str, name: str) -> dict | None:
    """``module.name`` (a registry of builtins), or None while that module does not exist."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise


class DataTableChecks:
    """The checks of ``[data]``; mixed into the config loader."""

    error: Any
    table: Any
    string: Any
    path: Any
    builtin_name: Any
    options: Any

    def data(self, table: dict) -> tuple[DataSpec, dict]:
        builtin, train, evals = table.get("builtin"), table.get("train"), table.get("eval")
        options = self.table(("data", "options"), table.get("options", {}))
        if builtin is None and train is None:
            raise self.error(("data",), 'set builtin (e.g. builtin = "python-source") or train '
                             '(datasets.load_dataset arguments, e.g. train = { path = "json", '
                             'data_files = "train.jsonl" })')
        if builtin is not None:
            self.string(("data", "builtin"), builtin)
            for other in ("train", "eval"):
                if other in table:
                    raise self.error(("data", other), "cannot be combined with builtin (builtin data "
                                     "sets bring their own train and eval splits)")
            registry = optional_registry("workbench.data.builtin", "BUILTIN_DATA")
            if registry is not None:
                self.builtin_name(("data", "builtin"), builtin, registry, "data set")
                common = optional_registry("workbench.data.builtin", "load_builtin_data")
                self.options(("data", "options"), options, registry[builtin], common)
        raw = copy.deepcopy(table)
        if train is not None:
            raw["train"] = train = self.dataset(("data", "train"), train)
        if evals is not None:
            self.table(("data", "eval"), evals)
            if evals and all(isinstance(v, dict) for v in evals.values()):
                evals = {name: self.dataset(("data", "eval", name), v) for name, v in evals.items()}
            else:
                evals = self.dataset(("data", "eval"), evals)
            raw["eval"] = evals
        processing = self.processing(table, raw)
        return DataSpec(builtin=builtin, options=dict(options), train=train, eval=evals, **processing), raw

    def processing(self, table: dict, raw: dict) -> dict:
        """Check the keys that prepare datasets-library data (renames, tokenizing, packing)."""
        given = [k for k in _PROCESSING_KEYS if k in table]
        if given and table.get("builtin") is not None:
            raise self.error(("data", given[0]), "cannot be combined with builtin (builtin data sets come "
                             "tokenized)")
        out: dict[str, Any] = {}
        if "columns" in table:
            columns = self.table(("data", "columns"), table["columns"])
            for old, new in columns.items():
                if not isinstance(new, str) or not new:
                    raise self.error(("data", "columns", old), f"expected the new column name (a non-empty "
                                     f"string), got {toml_repr(new)} ({kind_of(new)})")
            out["columns"] = dict(columns)
        if "text_column" in table:
            out["text_column"] = self.string(("data", "text_column"), table["text_column"])
        if "tokenizer" in table:
            name = self.string(("data", "tokenizer"), table["tokenizer"])
            if name != "char":
                folder = self.path(name)
                if not os.path.isdir(folder):
                    raise self.error(("data", "tokenizer"), f'folder {name!r} does not exist; use "char" for '
                                     "the built-in character tokenizer or a local transformers tokenizer folder")
                if importlib.util.find_spec("transformers") is None:
                    raise self.error(("data", "tokenizer"), "a tokenizer folder needs the transformers package "
                                     "(pip install 'workbench[hf]'); or use tokenizer = \"char\"")
                raw["tokenizer"] = name = folder
            out["tokenizer"] = name
        out.update(self.row_format(table))
        if "max_length" in table:
            value = table["max_length"]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise self.error(("data", "max_length"), f"expected a positive integer (tokens), got "
                                 f"{toml_repr(value)} ({kind_of(value)})")
            out["max_length"] = value
        if "packing" in table:
            if not isinstance(table["packing"], bool):
                raise self.error(("data", "packing"), f"expected true or false, got {toml_repr(table['packing'])} "
                                 f"({kind_of(table['packing'])})")
            out["packing"] = table["packing"]
        for name in ("max_length", "packing"):
            if name in table and "text_column" not in table and "format" not in table:
                raise self.error(("data", name), "applies when tokenizing: set text_column (the column of "
                                 'text to tokenize) or format ("messages" or "prompt-completion" rows)')
        if out.get("packing") and "max_length" not in table:
            raise self.error(("data", "packing"), "needs max_length (the block size in tokens)")
        return out

    def row_format(self, table: dict) -> dict:
        """Check ``format`` and ``completion_only_loss``: the chat and prompt/completion rows that
        take the place of ``text_column`` (one or the other: both would say what to tokenize)."""
        out: dict[str, Any] = {}
        if "format" in table:
            name = self.string(("data", "format"), table["format"])
            if name not in DATA_FORMATS:
                close = difflib.get_close_matches(name, DATA_FORMATS, n=1, cutoff=0.5)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise self.error(("data", "format"), f"unknown format {name!r}{hint}; choices: "
                                 f"{', '.join(DATA_FORMATS)}")
            if "text_column" in table:
                raise self.error(("data", "format"), "cannot be combined with text_column: format reads chat or "
                                 "prompt/completion rows, text_column tokenizes plain text; set one of them")
            out["format"] = name
        if "completion_only_loss" in table:
            value = table["completion_only_loss"]
            if not isinstance(value, bool):
                raise self.error(("data", "completion_only_loss"), f"expected true or false, got {toml_repr(value)} "
                                 f"({kind_of(value)})")
            if "format" not in table:
                raise self.error(("data", "completion_only_loss"), 'applies to chat data: set format = "messages" '
                                 'or "prompt-completion"')
            out["completion_only_loss"] = value
        return out

    def dataset(self, key: Key, table: Any) -> dict:
        """Check ``datasets.load_dataset`` arguments and make local paths absolute."""
        out = dict(self.table(key, table))
        if "path" not in out:
            raise self.error(key, 'missing path (the datasets.load_dataset builder or a local folder, '
                             'e.g. path = "json")')
        local = self.path(self.string(key + ("path",), out["path"]))
        if os.path.exists(local):
            out["path"] = local
        elif os.path.splitext(out["path"])[1].lower() in _DATA_FILE_EXTENSIONS:
            raise self.error(key + ("path",), f"file {out['path']!r} does not exist (looked for {local})")
        if "data_files" in out:
            out["data_files"] = self.data_files(key + ("data_files",), out["data_files"])
        return out

    def data_files(self, key: Key, value: Any) -> Any:
        if isinstance(value, dict):
            return {split: self.data_files(key + (str(split),), v) for split, v in value.items()}
        if isinstance(value, list):
            return [self.data_file(key, v) for v in value]
        return self.data_file(key, value)

    def data_file(self, key: Key, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(key, "expected a file name, a list of them, or a table of split = file(s); "
                             f"got {toml_repr(value)} ({kind_of(value)})")
        if "://" in value:
            return value
        full = self.path(value)
        if any(ch in value for ch in "*?[") and not glob.glob(full):
            raise self.error(key, f"no file matches {value!r} (looked in {os.path.dirname(full)})")
        if not any(ch in value for ch in "*?[") and not os.path.exists(full):
            raise self.error(key, f"file {value!r} does not exist (looked for {full})")
        return full
