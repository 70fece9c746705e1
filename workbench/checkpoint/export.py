"""``workbench export CHECKPOINT OUT [--merge]``: a checkpoint made into a standalone model
folder that transformers' own ``from_pretrained`` loads.

* A LoRA checkpoint without ``--merge``: the adapter folder (``adapter_model.safetensors``,
  ``adapter_config.json`` naming its base model's folder), loaded with
  ``AutoPeftModelForCausalLM.from_pretrained(OUT)`` or ``PeftModel.from_pretrained(base, OUT)``.
* A LoRA checkpoint with ``--merge``: the base model with the adapter merged into its
  weights (float32 arithmetic, as peft's ``merge_and_unload``), loaded with
  ``AutoModelForCausalLM.from_pretrained(OUT)`` without peft.
* A full checkpoint: its weights and model config.

The tokenizer files go with it (the checkpoint's, else the base model's). The checkpoint is
verified against its manifest first; OUT is written beside itself under a temporary name
and renamed into place once complete, and an OUT that exists and is not empty is refused,
so nothing saved is overwritten and a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from workbench.checkpoint.store import CheckpointStore
from workbench.core.names import MANIFEST, WEIGHTS, WEIGHTS_INDEX
from workbench.models.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_MISSING

__all__ = ["ExportError", "Exported", "export_checkpoint", "TOKENIZER_FILES"]

# The files a tokenizer (and a chat template) is saved as, by the kinds transformers writes.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
_MODEL_FILES = ("config.json", "generation_config.json")


class ExportError(ValueError):
    """Why a checkpoint cannot be exported, in one line that says what to do."""


@dataclass(frozen=True)
class Exported:
    """What an export wrote: the folder, its kind ("adapter", "merged", "full"), the base
    model folder an adapter names (None otherwise) and the files."""

    path: Path
    kind: str
    base: str | None
    files: tuple[str, ...]


def _check_source(checkpoint: Path) -> None:
    if not checkpoint.is_dir():
        raise ExportError(f"{checkpoint} is not a folder; pass a checkpoint (e.g. OUTPUT_DIR/checkpoint-500) "
                          "or a folder written by save_model")
    if (checkpoint / MANIFEST).is_file():
        ok, why = CheckpointStore(checkpoint.parent).verify(checkpoint)
        if not ok:
            raise ExportError(f"{checkpoint} is damaged: {why}")
    has_weights = any((checkpoint / name).is_file() for name in (ADAPTER_WEIGHTS, WEIGHTS, WEIGHTS_INDEX))
    if not has_weights:
        raise ExportError(f"{checkpoint} holds no model weights ({ADAPTER_WEIGHTS} or {WEIGHTS}); "
                          "it is not a checkpoint of a model")


def _check_target(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not empty; choose a new folder (nothing was written)")


def _adapter_base(checkpoint: Path) -> str:
    config = json.loads((checkpoint / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    base = config.get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise ExportError(f"{checkpoint}: the adapter's base model {base!r} is not a folder on this machine; "
                          f"copy the pretrained folder there or edit base_model_name_or_path in {ADAPTER_CONFIG}")
    return str(base)


def _copy_tokenizer(sources: list[Path], target: Path) -> None:
    """The tokenizer files of the first source that has any (the checkpoint, then the base)."""
    for source in sources:
        present = [name for name in TOKENIZER_FILES if (source / name).is_file()]
        if present:
            for name in present:
                shutil.copy2(source / name, target / name)
            return


def _model_class(folder: str):
    """The transformers class the folder's config names (AutoModel when it names none)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    names = getattr(config, "architectures", None) or []
    return getattr(transformers, names[0], None) if names else transformers.AutoModel


def _merge(checkpoint: Path, base: str, target: Path) -> None:
    try:
        from peft import PeftModel
    except ImportError:
        raise ExportError(f"--merge {PEFT_MISSING}") from None
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        model = _model_class(base).from_pretrained(base, local_files_only=True, dtype=torch.float32)
        merged = PeftModel.from_pretrained(model, str(checkpoint)).merge_and_unload()
    merged.save_pretrained(target, safe_serialization=True)


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, merge: bool = False) -> Exported:
    """Write ``checkpoint`` as a standalone model folder at ``out`` (see the module's text).

    Raises ExportError with one line for a missing, damaged or foreign checkpoint, a base
    model that is not there, ``--merge`` of a checkpoint without an adapter, or an ``out``
    that would be overwritten.
    """
    checkpoint, out = Path(checkpoint).absolute(), Path(out).absolute()
    _check_source(checkpoint)
    _check_target(out)
    adapter = (checkpoint / ADAPTER_WEIGHTS).is_file()
    if merge and not adapter:
        raise ExportError(f"{checkpoint} holds full weights, no LoRA adapter to merge; export it without --merge")
    if not adapter and not (checkpoint / "config.json").is_file():
        raise ExportError(f"{checkpoint} has no config.json: its model is not a transformers model, which "
                          "from_pretrained could load; its weights are in model.safetensors as they are")
    base = _adapter_base(checkpoint) if adapter else None
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        if merge:
            _merge(checkpoint, base, staging)
            kind = "merged"
        elif adapter:
            for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG, "README.md"):
                if (checkpoint / name).is_file():
                    shutil.copy2(checkpoint / name, staging / name)
            kind = "adapter"
        else:
            names = [WEIGHTS, WEIGHTS_INDEX, *_MODEL_FILES]
            if (checkpoint / WEIGHTS_INDEX).is_file():
                index = json.loads((checkpoint / WEIGHTS_INDEX).read_text(encoding="utf-8"))
                names += sorted(set(index["weight_map"].values()))
            for name in names:
                if (checkpoint / name).is_file():
                    shutil.copy2(checkpoint / name, staging / name)
            kind = "full"
        if merge and base is not None and (Path(base) / "generation_config.json").is_file() \
                and not (staging / "generation_config.json").is_file():
            shutil.copy2(Path(base) / "generation_config.json", staging / "generation_config.json")
        _copy_tokenizer([checkpoint] + ([Path(base)] if base else []), staging)
        if out.exists():
            out.rmdir()  # empty (checked above): the rename needs the name free
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Exported(path=out, kind=kind, base=base, files=tuple(sorted(p.name for p in out.iterdir())))
