"""The ``[data]`` table through the ``datasets`` library: load, rename, tokenize, pack.

* Loading (:func:`load_split`): local json/jsonl, csv, text, parquet and arrow files (by
  builder name, or a file path whose extension names the builder), ``save_to_disk``
  folders (``load_from_disk``), splits with slicing (``split = "train[:90%]"``), and named
  Hub data sets when the Hub is reachable; offline, a cached copy is used or the error says
  how to use a local file instead -- at once, without network retries.
* Column renames (``columns = { question = "text" }``).
* Chat and instruction rows (``format = "messages"`` or ``"prompt-completion"``), prepared by
  workbench/data/chat.py with labels on the answers only, cached the same way.
* Tokenization of ``text_column`` with the built-in CharTokenizer (``tokenizer = "char"``) or
  a transformers tokenizer from a local folder, truncated to ``max_length``; or, with
  ``packing = true``, texts concatenated and cut into blocks of ``max_length`` tokens for a
  causal LM (labels = inputs). Both run through ``Dataset.map`` with the result cached in
  ``output_dir/data_cache/`` under a name derived from the source data and the options, so
  a rerun or a resume reuses it; ``datasets``' progress bar shows on the headless CLI.

``datasets`` and ``transformers`` are imported inside the functions: importing this module
costs nothing, and transformers stays optional.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

__all__ = [
    "RunData",
    "check_text_column",
    "hub_reachable",
    "load_run_data",
    "load_split",
    "load_tokenizer",
    "rename_columns",
    "run_tokenizer",
    "tokenize_dataset",
]

# File extensions that name a datasets builder, for ``path = "data/train.jsonl"``.
EXTENSION_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".txt": "text",
                      ".text": "text", ".parquet": "parquet", ".arrow": "arrow"}
CACHE_FOLDER = "data_cache"


@dataclass
class RunData:
    """What ``[data]`` produced: the datasets and the tokenizer (the processing class), if any."""

    train: Any
    eval: Any
    tokenizer: Any = None


# -- loading ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _progress(enabled: bool) -> Iterator[None]:
    """Show or hide ``datasets``' progress bars for a block, restoring the previous setting."""
    import datasets
    from datasets.utils import are_progress_bars_disabled

    was_disabled = are_progress_bars_disabled()
    (datasets.enable_progress_bars if enabled else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.disable_progress_bars if was_disabled else datasets.enable_progress_bars)()


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers a TCP connect (False in offline mode).

    A quick probe so an offline machine fails in seconds instead of after the Hub client's
    retries with back-off (about 25 s).
    """
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Switch datasets and huggingface_hub to offline mode (cached copies only) for a block."""
    import datasets.config as dconfig
    import huggingface_hub.constants as hconfig

    saved = dconfig.HF_HUB_OFFLINE, hconfig.HF_HUB_OFFLINE
    dconfig.HF_HUB_OFFLINE = hconfig.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        dconfig.HF_HUB_OFFLINE, hconfig.HF_HUB_OFFLINE = saved


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def _slice_saved(dataset: Any, split: str | None, where: str) -> Any:
    """Pick the split (and slice, ``"train[10:20]"``, ``"train[:5%]"``) of a ``load_from_disk`` result."""
    import datasets

    spec = split or "train"
    name = spec.split("[", 1)[0].strip()
    if isinstance(dataset, datasets.DatasetDict):
        if name not in dataset:
            raise ValueError(f"{where}.split: the saved data set has no split {name!r}; "
                             f"splits: {', '.join(dataset)}")
        dataset = dataset[name]
    if "[" not in spec:
        return dataset
    try:
        instructions = datasets.ReadInstruction.from_spec(spec).to_absolute({name: len(dataset)})
    except (ValueError, AssertionError) as exc:
        raise ValueError(f"{where}.split: cannot read {spec!r} ({exc})") from None
    parts = [dataset.select(range(i.from_, i.to)) for i in instructions]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def load_split(table: dict[str, Any], where: str = "data.train") -> Any:
    """One data set from a ``[data.train]``-style table of ``datasets.load_dataset`` arguments.

    ``path`` may be a builder name (``"json"``, ``"csv"``, ``"text"``, ``"parquet"``,
    ``"arrow"``) with ``data_files``, a local data file (its extension names the builder), a
    ``save_to_disk`` folder, another local folder, or a Hub data set name. ``split``
    defaults to ``"train"`` and takes slices. Errors are one line prefixed with ``where``.
    """
    import datasets

    kwargs = dict(table)
    path = str(kwargs.pop("path"))
    kwargs.setdefault("split", "train")
    local = Path(path)
    if local.is_dir() and _is_saved_dataset(local):
        extra = sorted(set(kwargs) - {"split"})
        if extra:
            raise ValueError(f"{where}: {path} is a save_to_disk folder, which takes only split "
                             f"(not {', '.join(extra)})")
        return _slice_saved(datasets.load_from_disk(str(local)), kwargs["split"], where)
    if local.is_file():
        builder = EXTENSION_BUILDERS.get(local.suffix.lower())
        if builder is None:
            raise ValueError(f"{where}.path: cannot tell the format of {path} from its extension; use "
                             f"path = \"json\" (or csv, text, parquet, arrow) with data_files = \"{path}\"")
        kwargs.setdefault("data_files", str(local))
        if local.suffix.lower() == ".tsv":
            kwargs.setdefault("sep", "\t")
        path = builder
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    on_hub = not local.exists() and path not in _PACKAGED_DATASETS_MODULES
    if on_hub and not hub_reachable():
        try:
            with _offline():
                return datasets.load_dataset(path, **kwargs)
        except Exception:
            raise RuntimeError(
                f"{where}.path: {path!r} is a data set on the Hugging Face Hub, which cannot be reached "
                "(offline) and is not in the local cache; download it where there is network access "
                f"(datasets.load_dataset({path!r}).save_to_disk(\"DIR\")) and set path = \"DIR\", or use a "
                "local file: path = \"json\", data_files = \"train.jsonl\""
            ) from None
    from workbench.data.file_errors import DataFileError, causes, check_rows, explain_failure, local_files, no_rows

    files = local_files(path, kwargs.get("data_files"))
    try:
        with _quiet_logs():  # datasets logs its own error line before raising: one is enough
            dataset = datasets.load_dataset(path, **kwargs)
    except Exception as exc:
        line = explain_failure(exc, files, path, kwargs) if files else None
        if line is not None:
            raise DataFileError(f"{line} ({where})") from None
        if any("corresponds to no data" in str(link) for link in causes(exc)):  # a header-only csv, an empty slice
            raise DataFileError(no_rows(where, files, kwargs.get("split"))) from None
        if not files and not isinstance(exc, (FileNotFoundError, ValueError, TypeError, ConnectionError)):
            raise
        raise RuntimeError(f"{where}: loading {path!r} failed: {_deepest_message(exc)}") from None
    check_rows(dataset, where, files, kwargs.get("split"))
    return dataset


def _deepest_message(exc: BaseException) -> str:
    """The first line of the innermost cause that says something (datasets wraps the
    parser's error in its own "An error occurred while generating the dataset")."""
    from workbench.data.file_errors import causes

    text = next((t for t in (str(link).strip() for link in reversed(list(causes(exc)))) if t), type(exc).__name__)
    return text.splitlines()[0]


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    from datasets.utils import logging as dlogging

    level = dlogging.get_verbosity()
    dlogging.set_verbosity(dlogging.CRITICAL + 1)
    try:
        yield
    finally:
        dlogging.set_verbosity(level)


def rename_columns(dataset: Any, columns: dict[str, str], where: str = "data.columns") -> Any:
    """``dataset`` with columns renamed ``{old: new}``; a missing column is a clear error."""
    if not columns:
        return dataset
    present = list(dataset.column_names or [])
    missing = [old for old in columns if old not in present]
    if missing and present:
        raise ValueError(f"{where}: no column {missing[0]!r} to rename; columns: {', '.join(present)}")
    return dataset.rename_columns(dict(columns))


# -- tokenizers ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def load_tokenizer(name: str) -> Any:
    """``"char"``: the built-in CharTokenizer; else a transformers tokenizer from a local folder.

    A tokenizer without a pad token gets its end-of-sequence token as pad (padding is masked
    out, so the id does not matter), so batches of different lengths can be padded.
    """
    if name == "char":
        from workbench.data.builtin import CharTokenizer

        return CharTokenizer()
    try:
        import transformers
    except ImportError:
        raise RuntimeError(f"data.tokenizer: loading the tokenizer in {name} needs the transformers package "
                           "(pip install 'workbench[hf]'), or use tokenizer = \"char\"") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"data.tokenizer: cannot load a tokenizer from {name}: "
                           f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None
    if getattr(tokenizer, "pad_token_id", None) is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def run_tokenizer(run: Any) -> Any:
    """The tokenizer ``[data]`` asks for: ``tokenizer`` if set; with a ``text_column`` or a
    ``format`` and no tokenizer, the ``[model] pretrained`` folder's tokenizer, else the
    CharTokenizer; else None."""
    data = run.data
    if data.tokenizer is not None:
        return load_tokenizer(data.tokenizer)
    if data.text_column is None and getattr(data, "format", None) is None:
        return None
    return load_tokenizer(run.model.pretrained or "char")


def _tokenizer_identity(tokenizer: Any) -> str:
    """A string that changes when the tokenizer would encode differently (for cache names)."""
    from workbench.data.builtin import CharTokenizer

    if isinstance(tokenizer, CharTokenizer):
        return f"char:{tokenizer.vocab_size}"
    folder = getattr(tokenizer, "name_or_path", "") or ""
    files = []
    if folder and os.path.isdir(folder):
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.is_file():
                stat = entry.stat()
                files.append((entry.name, stat.st_size, int(stat.st_mtime)))
    return json.dumps([type(tokenizer).__name__, folder, files, getattr(tokenizer, "padding_side", None)])


def _encode(tokenizer: Any, texts: list[str], max_length: int | None) -> dict[str, list]:
    from workbench.data.builtin import CharTokenizer

    texts = ["" if t is None else str(t) for t in texts]
    if isinstance(tokenizer, CharTokenizer):
        ids = [tokenizer.encode(t) for t in texts]
        return {"input_ids": [x[:max_length] for x in ids] if max_length else ids}
    encoded = tokenizer(texts, truncation=max_length is not None, max_length=max_length)
    return {k: list(v) for k, v in encoded.items()}


def _tokenize_batch(batch: dict[str, list], *, tokenizer: Any, text_column: str, max_length: int | None,
                    length_column: str | None) -> dict[str, list]:
    out = _encode(tokenizer, batch[text_column], max_length)
    if length_column:
        out[length_column] = [len(ids) for ids in out["input_ids"]]
    return out


def _pack_batch(batch: dict[str, list], *, tokenizer: Any, text_column: str, block: int) -> dict[str, list]:
    # As HF's run_clm: texts of one map batch are joined (an end-of-sequence token after each,
    # when the tokenizer has one) and cut into full blocks; the short remainder is dropped.
    eos = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    for ids in _encode(tokenizer, batch[text_column], None)["input_ids"]:
        stream.extend(ids)
        if eos is not None:
            stream.append(eos)
    usable = len(stream) // block * block
    blocks = [stream[i:i + block] for i in range(0, usable, block)]
    return {"input_ids": blocks, "labels": [list(b) for b in blocks]}


def check_text_column(dataset: Any, text_column: str, where: str = "data.text_column") -> None:
    """ValueError (one line, the columns there are) unless ``dataset`` has ``text_column``."""
    columns = list(dataset.column_names or [])
    if columns and text_column not in columns:
        raise ValueError(f"{where}: no column {text_column!r} in the data; columns: {', '.join(columns)}")


def tokenize_dataset(dataset: Any, tokenizer: Any, *, text_column: str, max_length: int | None = None,
                     packing: bool = False, length_column: str | None = None, cache_dir: str | Path | None = None,
                     desc: str = "Tokenizing", progress: bool = True, where: str = "data.text_column",
                     in_memory: bool = False) -> Any:
    """Tokenize ``text_column`` of ``dataset`` with ``Dataset.map``, cached in ``cache_dir``.

    Without packing, ``text_column`` is replaced by ``input_ids`` (plus what the tokenizer
    returns, e.g. ``attention_mask``), truncated to ``max_length``, and other columns (labels)
    stay; ``length_column`` adds each sample's length for the length-aware samplers. With
    ``packing``, all columns are replaced by ``max_length``-token blocks of ``input_ids`` and
    identical ``labels``. The cache file name hashes the source data's fingerprint and every
    option, so a changed input or option never reuses a stale result. ``in_memory`` keeps
    the result in memory (no cache file anywhere).
    """
    columns = list(dataset.column_names or [])
    check_text_column(dataset, text_column, where)
    if packing and not max_length:
        raise ValueError(f"{where}: packing needs max_length (the block size in tokens)")
    if packing:
        function, fn_kwargs = _pack_batch, {"tokenizer": tokenizer, "text_column": text_column, "block": max_length}
        remove = columns
    else:
        function = _tokenize_batch
        fn_kwargs = {"tokenizer": tokenizer, "text_column": text_column, "max_length": max_length,
                     "length_column": length_column}
        remove = [text_column]
    if not hasattr(dataset, "cache_files"):  # an IterableDataset: mapped lazily while iterating
        return dataset.map(function, batched=True, fn_kwargs=fn_kwargs, remove_columns=remove or None)
    options = {"source": getattr(dataset, "_fingerprint", None), "rows": len(dataset), "text_column": text_column,
               "max_length": max_length, "packing": packing, "length_column": length_column,
               "tokenizer": _tokenizer_identity(tokenizer), "version": 1}
    key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]
    kwargs: dict[str, Any] = {"new_fingerprint": key}
    if cache_dir is not None:
        folder = Path(cache_dir)
        folder.mkdir(parents=True, exist_ok=True)
        kwargs.update(cache_file_name=str(folder / f"tokenized-{key}.arrow"), load_from_cache_file=True)
    elif in_memory:
        kwargs.update(keep_in_memory=True)
    with _progress(progress):
        return dataset.map(function, batched=True, fn_kwargs=fn_kwargs, remove_columns=remove, desc=desc, **kwargs)


def _prepare_chat(dataset: Any, tokenizer: Any, data: Any, *, where: str, label: str, length_column: str | None,
                  cache_dir: Path | None, progress: bool) -> Any:
    """``format`` rows through workbench/data/chat.py, cached under a name that changes with the
    source data, every option and the tokenizer (its files and its chat template)."""
    from workbench.data.chat import VERSION, prepare_chat_dataset

    options = {"source": getattr(dataset, "_fingerprint", None), "rows": len(dataset) if hasattr(dataset, "__len__")
               else None, "format": data.format, "completion_only_loss": data.completion_only_loss,
               "max_length": data.max_length, "packing": data.packing, "length_column": length_column,
               "tokenizer": _tokenizer_identity(tokenizer), "chat_template": getattr(tokenizer, "chat_template", None),
               "version": VERSION}
    key = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()[:16]
    cache_file = None
    if cache_dir is not None and hasattr(dataset, "cache_files"):
        cache_dir.mkdir(parents=True, exist_ok=True)
        cache_file = str(cache_dir / f"chat-{key}.arrow")
    # The bar only on a terminal: a bad row is found while mapping, and its one line must not
    # follow a bar written into a log.
    with _progress(progress and sys.stderr.isatty()):
        return prepare_chat_dataset(dataset, tokenizer, format=data.format,
                                    completion_only_loss=data.completion_only_loss, max_length=data.max_length,
                                    packing=data.packing, length_column=length_column, cache_file=cache_file,
                                    fingerprint=key, desc=f"Preparing {label} ({data.format})", where=where)


@contextlib.contextmanager
def _undo_on_failure(folder: Path | None) -> Iterator[None]:
    """On an error in the block, remove what it wrote into ``folder``: the folders it made
    (up to output_dir, and output_dir itself when it made it), else the entries it added.
    Broken data never leaves a cache, nor an output_dir, behind."""
    if folder is None:
        yield
        return
    made = None
    probe = folder
    while not probe.exists() and probe.parent != probe:
        made, probe = probe, probe.parent
    before = set(os.listdir(folder)) if made is None and folder.is_dir() else set()
    try:
        yield
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        elif folder.is_dir():
            for name in set(os.listdir(folder)) - before:
                path = folder / name
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        raise


# -- the whole [data] table ------------------------------------------------------------------


def _main_process_first(args: Any) -> contextlib.AbstractContextManager:
    """Under a launcher rank 0 tokenizes and writes the cache first; the others read it.

    The distributed state is the run's own (world.py), made here with the Trainer's
    arguments when data loading is the first to need it.
    """
    from workbench.core.world import distributed_state, launched_world_size

    world = launched_world_size()
    if world is None or world[0] <= 1:
        return contextlib.nullcontext()
    return distributed_state(args).main_process_first()


def load_run_data(run: Any, *, progress: bool = True, cache: bool = True) -> RunData:
    """Train and eval data sets (and the tokenizer) for a validated RunConfig's ``[data]``.

    ``progress`` shows ``datasets``' progress bars (the headless CLI); the tokenized data is
    cached in ``output_dir/data_cache``, or with ``cache`` False kept in memory (nothing is
    written into output_dir: ``workbench data``). The length column that ``group_by_length`` and
    ``batch_rebalance`` read is added while tokenizing the train set. A failure while
    tokenizing removes what it wrote into output_dir (and the folders it made for it).
    """
    data, training = run.data, run.training
    row_format = getattr(data, "format", None)
    tokenizer = run_tokenizer(run)
    cache_dir = Path(training.output_dir) / CACHE_FOLDER if cache else None
    wants_lengths = training.train_sampling_strategy in ("group_by_length", "batch_rebalance")

    def load(table: dict, where: str) -> Any:
        # No bar while a local file is read: a broken one must end in one line, not a bar and a line.
        with _progress(False):
            return rename_columns(load_split(table, where), data.columns)

    def tokenize(dataset: Any, where: str, label: str, lengths: bool) -> Any:
        length_column = training.length_column_name if lengths and not data.packing else None
        if row_format is not None:
            return _prepare_chat(dataset, tokenizer, data, where=where, label=label, length_column=length_column,
                                 cache_dir=cache_dir, progress=progress)
        if data.text_column is None:
            return dataset
        tokenized = tokenize_dataset(
            dataset, tokenizer, text_column=data.text_column, max_length=data.max_length, packing=data.packing,
            length_column=length_column, cache_dir=cache_dir, desc=f"Tokenizing {label}", progress=progress,
            where=f"data.text_column ({where})", in_memory=not cache,
        )
        if data.packing and hasattr(tokenized, "__len__") and not len(tokenized):
            raise ValueError(f"{where}: packing into blocks of data.max_length = {data.max_length} tokens left no "
                             "block (the texts are shorter than one block); lower max_length or add data")
        return tokenized

    # Every split is read and checked before any is tokenized: tokenizing writes its cache
    # into output_dir, which a broken eval file must not leave behind.
    named: dict[str, tuple[dict, str]] = {}
    if data.train:
        named["train"] = (data.train, "data.train")
    if data.eval and all(isinstance(v, dict) for v in data.eval.values()):
        named.update({f"eval {name}": (t, f"data.eval.{name}") for name, t in data.eval.items()})
    elif data.eval:
        named["eval"] = (data.eval, "data.eval")
    with _main_process_first(training):
        raw = {label: load(table, where) for label, (table, where) in named.items()}
        if data.text_column is not None:
            for label, dataset in raw.items():
                check_text_column(dataset, data.text_column, f"data.text_column ({named[label][1]})")
        if row_format is not None:
            from workbench.data.chat import check_chat_columns, check_chat_tokenizer

            check_chat_tokenizer(tokenizer, row_format)
            for label, dataset in raw.items():
                check_chat_columns(dataset, row_format, named[label][1])
        with _undo_on_failure(cache_dir):
            ready = {label: tokenize(dataset, named[label][1], label, label == "train" and wants_lengths)
                     for label, dataset in raw.items()}
    train = ready.get("train")
    if data.eval and all(isinstance(v, dict) for v in data.eval.values()):
        evaluation = {name: ready[f"eval {name}"] for name in data.eval}
    else:
        evaluation = ready.get("eval")
    return RunData(train=train, eval=evaluation, tokenizer=tokenizer)
