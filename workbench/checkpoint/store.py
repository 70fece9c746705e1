"""Checkpoints: atomic publish, a cheap catalog, verification, rotation and loading.

A checkpoint is written into ``.tmp-checkpoint-<step>/``; ``manifest.json`` (sizes and
sha256 of every file) is written last and fsynced, then the folder is renamed to
``checkpoint-<step>``. A folder without a manifest that verifies is incomplete and is
never picked for resume. Rotation deletes by renaming to ``.trash-*`` first, so a crash
mid-delete never leaves a half-deleted checkpoint that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from workbench.checkpoint.state_dicts import (
    capture_model_state,
    capture_optimizer_state,
    host_copy,
    load_model_state,
    load_optimizer_state,
    unique_state,
)
from workbench.train.trainer_utils import PREFIX_CHECKPOINT_DIR, unwrap_model

if TYPE_CHECKING:
    from workbench.train.trainer import Trainer

log = logging.getLogger("workbench")

__all__ = [
    "CheckpointInfo",
    "CheckpointStore",
    "save_checkpoint",
    "load_training_state",
    "load_best_model",
    "save_model_files",
    "load_model_files",
    "model_saved_by_override",
    "MANIFEST",
]

MANIFEST = "manifest.json"
SENTINEL = "checkpoint-is-incomplete.txt"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
SHARD_BYTES = 5 * 1024**3
_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class CheckpointInfo:
    """One catalog row. ``complete`` means a manifest exists; ``verified`` that it was checked."""

    name: str
    path: str
    step: int
    epoch: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    size: int = 0
    created: float | None = None
    complete: bool = False
    verified: bool | None = None
    best: bool = False
    protected: bool = False  # rotation never deletes it (the best, and the newest complete)
    problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The row as a JSON-friendly dict."""
        return asdict(self)


class CheckpointStore:
    """The checkpoints of one output directory."""

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.root = Path(output_dir)

    # -- writing -------------------------------------------------------------------------

    def publish(self, step: int, write: Callable[[Path], None]) -> Path:
        """Have ``write`` fill a temporary folder, seal it with a manifest, rename it in place."""
        return self.seal(step, self.begin(step), write)

    def temporary(self, step: int) -> Path:
        """The folder a checkpoint of ``step`` is written into before it is published."""
        return self.root / f".tmp-{PREFIX_CHECKPOINT_DIR}-{step}"

    def begin(self, step: int) -> Path:
        """Create the temporary folder of ``step``'s checkpoint, with the sentinel in it."""
        tmp = self.temporary(step)
        final = self.root / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp)
            elif tmp.exists() or tmp.is_symlink():
                tmp.unlink()
            tmp.mkdir()
            # The reference's sentinel: present while the save runs. Here it never reaches a
            # published folder, since the rename happens only after it is gone.
            (tmp / SENTINEL).write_text("this checkpoint is still being written\n", encoding="utf-8")
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise OSError(f"saving {final.name}: cannot write into the output directory {self.root} "
                          f"({exc.strerror or exc}); the earlier checkpoints there are intact") from exc
        return tmp

    def seal(self, step: int, tmp: Path, write: Callable[[Path], None] | None = None) -> Path:
        """Run ``write`` into ``tmp``, then checksum everything in it and publish it atomically.

        Other ranks' files must be in ``tmp`` before this is called (they are hashed too).
        """
        final = self.root / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        try:
            if write is not None:
                write(tmp)
            (tmp / SENTINEL).unlink()
            files = {}
            for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
                with open(path, "rb+") as f:
                    os.fsync(f.fileno())
                files[str(path.relative_to(tmp))] = {"size": path.stat().st_size, "sha256": _sha256(path)}
            manifest = {"format": 1, "step": step, "created": time.time(), "files": files}
            with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
        except Exception as exc:
            # A full disk, a quota, a failing device: drop the half-written folder and say
            # which save failed; nothing published before was touched.
            shutil.rmtree(tmp, ignore_errors=True)
            if not isinstance(exc, OSError) and type(exc).__name__ != "SafetensorError":
                raise  # not a storage problem: a bug shows its own traceback
            raise OSError(f"saving {final.name} into {self.root} failed ({type(exc).__name__}: {exc}); "
                          "the earlier checkpoints there are intact and can be resumed from") from exc
        if final.exists():
            # Re-saving a step (e.g. save at the end after a save at the same step): move the
            # old copy aside and delete it only once the new one is published.
            trash = final.with_name(f".trash-{final.name}-{time.time_ns()}")
            os.replace(final, trash)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            shutil.rmtree(trash, ignore_errors=True)
            return final
        os.replace(tmp, final)
        _fsync_dir(self.root)
        return final

    def _discard(self, path: Path) -> None:
        trash = path.with_name(f".trash-{path.name}-{time.time_ns()}")
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def delete(self, name: str) -> None:
        """Delete one checkpoint by folder name; the protected ones (best, newest complete) are refused.

        Renamed to ``.trash-*`` before removal, like rotation, so a crash mid-delete never
        leaves a half-deleted folder that looks complete.
        """
        info = next((c for c in self.list() if c.name == name), None)
        if info is None:
            raise ValueError(f"{name}: no such checkpoint in {self.root}")
        if info.protected:
            raise ValueError(f"{name} is protected (the best or the newest complete checkpoint)")
        self._discard(Path(info.path))

    def clean_temporaries(self) -> list[str]:
        """Remove leftovers of interrupted saves and deletes; returns their names."""
        removed = []
        if not self.root.is_dir():
            return removed
        for path in self.root.iterdir():
            if path.is_dir() and path.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
        if removed:
            log.warning("removed leftovers of interrupted saves in %s: %s", self.root, ", ".join(sorted(removed)))
        return removed

    def rotate(self, limit: int | None, keep: set[str] = frozenset()) -> list[str]:
        """Delete the oldest complete checkpoints beyond ``limit``, never those named in ``keep``."""
        if not limit:
            return []
        complete = [c for c in self.list() if c.complete]
        excess = len(complete) - limit
        deleted = []
        # Oldest first; the newest is never deleted (it is what --resume needs), so with a kept
        # best checkpoint the folder may hold limit + 1 checkpoints, as HF keeps best + last.
        for info in complete[:-1]:
            if excess <= 0:
                break
            if info.best or info.name in keep or info.path in keep:
                continue
            self._discard(Path(info.path))
            deleted.append(info.name)
            excess -= 1
        return deleted

    # -- reading ---------------------------------------------------------------------------

    def list(self) -> list[CheckpointInfo]:
        """The catalog, oldest first. Cheap: reads small JSON files, hashes nothing."""
        if not self.root.is_dir():
            return []
        rows = []
        best_by_step: dict[int, str] = {}
        for path in self.root.iterdir():
            match = _NAME.match(path.name)
            if not match or not path.is_dir():
                continue
            info = CheckpointInfo(name=path.name, path=str(path), step=int(match.group(1)))
            manifest = path / MANIFEST
            info.complete = manifest.is_file()
            try:
                if info.complete:
                    data = json.loads(manifest.read_text(encoding="utf-8"))
                    info.created = data.get("created")
                    info.size = sum(f["size"] for f in data["files"].values())
                else:
                    info.size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
                state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
                info.epoch = state.get("epoch")
                if state.get("best_model_checkpoint"):
                    best_by_step[info.step] = state["best_model_checkpoint"]
                for entry in state.get("log_history", []):
                    if entry.get("step") == info.step:
                        info.metrics.update({k: v for k, v in entry.items()
                                             if k.startswith("eval_") and isinstance(v, (int, float))})
            except (OSError, ValueError, KeyError) as exc:
                info.problem = f"unreadable: {exc}"
                info.complete = False
            rows.append(info)
        rows.sort(key=lambda r: r.step)
        # The newest checkpoint's trainer_state knows the best one (older ones knew less).
        best_path = best_by_step[max(best_by_step)] if best_by_step else None
        if best_path:
            for row in rows:
                row.best = Path(row.path).name == Path(best_path).name
        complete = [r for r in rows if r.complete]
        for row in rows:
            row.protected = row.best or (bool(complete) and row is complete[-1])
        return rows

    def verify(self, path: str | os.PathLike, hashes: bool = True) -> tuple[bool, str | None]:
        """Check every file against the manifest: sizes, and sha256 unless ``hashes`` is False
        (a quick structural check before any work; loading verifies the hashes)."""
        path = Path(path)
        manifest = path / MANIFEST
        if not manifest.is_file():
            return False, "no manifest.json (the save did not finish)"
        try:
            files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        except (ValueError, KeyError) as exc:
            return False, f"manifest.json is unreadable ({exc})"
        for rel, meta in files.items():
            target = path / rel
            if not target.is_file():
                return False, f"{rel} is missing"
            if target.stat().st_size != meta["size"]:
                return False, f"{rel} has {target.stat().st_size} bytes, the manifest says {meta['size']}"
            if hashes and _sha256(target) != meta["sha256"]:
                return False, f"{rel} does not match its sha256"
        return True, None

    def latest_verified(self) -> CheckpointInfo | None:
        """The newest checkpoint whose manifest verifies; skipped ones are logged by name."""
        for info in reversed(self.list()):
            ok, why = self.verify(info.path) if info.complete else (False, info.problem or "incomplete")
            if ok:
                info.verified = True
                return info
            log.warning("skipping %s: %s", info.name, why)
        return None

    def resolve_resume(self, resume: str | bool | os.PathLike) -> Path:
        """The checkpoint folder for ``resume_from_checkpoint`` (True: newest verified)."""
        if resume is True:
            info = self.latest_verified()
            if info is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.root})")
            return Path(info.path)
        path = Path(resume)
        if not path.is_dir():
            raise ValueError(f"resume_from_checkpoint: {path} is not a checkpoint folder")
        ok, why = self.verify(path)
        if not ok:
            raise ValueError(f"resume_from_checkpoint: {path} cannot be used: {why}")
        return path


# -- what goes into a checkpoint ----------------------------------------------------------


def save_model_files(model: torch.nn.Module, directory: Path, processing_class: Any = None,
                     max_shard_bytes: int | None = None, state: dict[str, torch.Tensor] | None = None) -> None:
    """Weights as safetensors (HF models through save_pretrained), plus the processing class.

    ``state`` is the weights to write (host copies taken earlier, or gathered from FSDP);
    by default the model's own. Weights above ``max_shard_bytes`` (default 5 GB) are split
    into ``model-0000i-of-0000n.safetensors`` files with ``model.safetensors.index.json``,
    the layout transformers reads.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained") and hasattr(model, "config") and not isinstance(model.config, dict):
        extra = {"state_dict": state} if state is not None else {}
        model.save_pretrained(directory, safe_serialization=True, **extra)
    else:
        from safetensors.torch import save_file

        limit = max_shard_bytes or SHARD_BYTES
        if state is None:
            state = unique_state(model)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > limit:
                shards.append({})
                size = 0
            shards[-1][name] = tensor
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(directory / WEIGHTS), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(directory / file), metadata={"format": "pt"})
                weight_map.update({name: file for name in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2), encoding="utf-8")
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(directory)


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class CheckpointContents:
    """Everything a checkpoint holds, as host copies: taking it is the only part of a save
    that must happen at the step boundary; writing can follow later (or elsewhere)."""

    step: int
    model: torch.nn.Module | None  # None: an overriding Trainer.save_model wrote the weights
    processing_class: Any
    weights: dict[str, torch.Tensor] | None  # None on ranks other than 0
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    rng: dict[str, Any] | None  # single process; with several each rank writes its own
    trainer_state: str
    training_args: str

    @classmethod
    def capture(cls, trainer: "Trainer", with_model: bool = True) -> "CheckpointContents":
        """Copy the run's state to host memory (a collective under FSDP: every rank calls it).

        ``with_model=False`` leaves the weights (and processing class) out, for a checkpoint
        whose model files the Trainer's own ``save_model`` writes.
        """
        args, acc = trainer.args, trainer.accelerator
        main = acc.is_main_process
        weights = capture_model_state(trainer) if with_model else None
        full = not args.save_only_model
        optimizer = capture_optimizer_state(trainer) if full else None
        scaler = getattr(acc, "scaler", None)
        return cls(
            step=trainer.state.global_step,
            model=unwrap_model(trainer.model) if with_model else None,
            processing_class=trainer.processing_class,
            weights=weights,
            optimizer=optimizer,
            scheduler=host_copy(trainer.lr_scheduler.state_dict()) if full and main else None,
            scaler=host_copy(scaler.state_dict()) if full and main and scaler is not None else None,
            rng=_rng_state() if full and acc.num_processes == 1 else None,
            trainer_state=trainer.state.to_json_string(),
            training_args=args.to_json_string() + "\n",
        )

    def write(self, directory: Path) -> None:
        """Write the files of the checkpoint into ``directory`` (rank 0's part)."""
        if self.model is not None:
            save_model_files(self.model, directory, self.processing_class, state=self.weights)
        for name, value in (("optimizer.pt", self.optimizer), ("scheduler.pt", self.scheduler),
                            ("scaler.pt", self.scaler), ("rng_state.pth", self.rng)):
            if value is not None:
                torch.save(value, directory / name)
        (directory / "trainer_state.json").write_text(self.trainer_state, encoding="utf-8")
        (directory / "training_args.json").write_text(self.training_args, encoding="utf-8")


def model_saved_by_override(trainer: "Trainer") -> bool:
    """Whether the Trainer's class overrides ``save_model`` (checked at each save, not per step).

    The rule for a checkpoint's model files, as HF's ``_save_checkpoint`` (which calls
    ``self.save_model(output_dir, _internal_call=True)``): an overriding ``save_model`` is
    called with the checkpoint's temporary folder (renamed to ``checkpoint-<step>`` once
    sealed), on every process, at the step boundary, and writes them. The built-in ``save_model`` is not called: the checkpoint writes the same files
    itself, from host copies taken at the boundary, so ``save_async`` can write them later.
    """
    from workbench.train.trainer import Trainer

    return getattr(type(trainer), "save_model", None) is not Trainer.save_model


def save_checkpoint(trainer: "Trainer") -> Path | None:
    """Write ``checkpoint-<global_step>`` for the trainer's current state, then rotate.

    The model files come from an overriding ``Trainer.save_model`` if there is one
    (``model_saved_by_override`` gives the rule); ``training_args.json`` and the rest are
    always written here, so a resume can compare arguments whatever the override wrote.
    """
    args, state, acc = trainer.args, trainer.state, trainer.accelerator
    step = state.global_step
    store = CheckpointStore(args.output_dir)
    name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
    if state.best_global_step == step:
        state.best_model_checkpoint = str(Path(args.output_dir) / name)
    for cb in trainer.callback_handler.callbacks:
        if hasattr(cb, "state") and callable(cb.state) and hasattr(type(cb), "from_state"):
            state.stateful_callbacks[type(cb).__name__] = cb.state()
    custom_model_save = model_saved_by_override(trainer)
    contents = CheckpointContents.capture(trainer, with_model=not custom_model_save)

    keep = {Path(state.best_model_checkpoint).name} if state.best_model_checkpoint else set()
    writer = trainer.checkpoint_writer

    def publish(tmp: Path | None = None) -> Path:
        path = store.publish(step, contents.write) if tmp is None else store.seal(step, tmp, contents.write)
        store.rotate(args.save_total_limit, keep=keep)
        return path

    path = None
    tmp = None
    if acc.num_processes > 1 or custom_model_save:
        # Every rank writes its own RNG streams (and takes part in save_model) into the folder
        # rank 0 opened; rank 0 adds the rest and publishes only after all of them have
        # written (the manifest covers all).
        if acc.is_main_process:
            writer.wait()  # the previous save owns the output directory until it has published
            tmp = store.begin(step)
        acc.wait_for_everyone()
        if custom_model_save:
            trainer.save_model(str(store.temporary(step)), _internal_call=True)
        if acc.num_processes > 1 and not args.save_only_model:
            torch.save(_rng_state(), store.temporary(step) / f"rng_state_{acc.process_index}.pth")
        acc.wait_for_everyone()
    if acc.is_main_process:
        if args.save_async:
            writer.submit(lambda: publish(tmp))
            path = store.root / name  # where it will be once published
        else:
            writer.wait()
            path = publish(tmp)
    acc.wait_for_everyone()
    return path


def _load(path: Path) -> Any:
    # Only tensors and plain containers: a pickle that would run code is refused.
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln or "global" in ln.lower()]
        detail = lines[-1] if lines else str(exc).splitlines()[0]
        raise ValueError(f"{path}: refused to load: the file holds more than tensors and plain containers "
                         f"(torch.load weights_only=True: {detail}); it was not unpickled") from exc


def _read_weights(model: torch.nn.Module, checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = []
    if (checkpoint / WEIGHTS).is_file():
        files = [checkpoint / WEIGHTS]
    elif (checkpoint / WEIGHTS_INDEX).is_file():
        index = json.loads((checkpoint / WEIGHTS_INDEX).read_text(encoding="utf-8"))
        files = [checkpoint / f for f in sorted(set(index["weight_map"].values()))]
    if files:
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        return state
    if hasattr(model, "from_pretrained") and (checkpoint / "config.json").is_file():
        return type(model).from_pretrained(checkpoint).state_dict()
    raise ValueError(f"{checkpoint} has no {WEIGHTS}")


def _check_fit(model: torch.nn.Module, checkpoint: Path, missing: list[str], unexpected: list[str]) -> None:
    # Tied weights are stored once, so their second names are expected to be missing.
    seen: set[int] = set()
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    if unexpected or set(missing) - aliases:
        raise ValueError(f"{checkpoint}: weights do not fit the model (missing: {sorted(set(missing) - aliases)[:5]}, "
                         f"unexpected: {sorted(unexpected)[:5]})")


def load_model_files(model: torch.nn.Module, checkpoint: Path) -> None:
    """Load the weights saved in ``checkpoint`` into a plain (unwrapped) model."""
    missing, unexpected = model.load_state_dict(_read_weights(model, checkpoint), strict=False)
    _check_fit(model, checkpoint, list(missing), list(unexpected))


def _load_weights(trainer: "Trainer", checkpoint: Path) -> None:
    model = unwrap_model(trainer.model)
    missing, unexpected = load_model_state(trainer, _read_weights(model, checkpoint))
    _check_fit(model, checkpoint, missing, unexpected)


def _fit_groups(scheduler_state: dict[str, Any], groups: int) -> dict[str, Any]:
    """A schedule saved for another number of parameter groups (see state_dicts.regroup),
    with its per-group lists cut or repeated to ``groups`` entries."""
    out = dict(scheduler_state)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        values = out.get(key)
        if isinstance(values, list) and values and len(values) != groups:
            out[key] = (values + [values[-1]] * groups)[:groups]
    return out


def load_training_state(trainer: "Trainer", checkpoint: Path) -> None:
    """Restore weights, optimizer, schedule, RNG, TrainerState (and callbacks) from ``checkpoint``."""
    from workbench.train.callbacks import TrainerState

    acc = trainer.accelerator
    _load_weights(trainer, checkpoint)
    if (checkpoint / "optimizer.pt").is_file():
        load_optimizer_state(trainer, _load(checkpoint / "optimizer.pt"))
        trainer.lr_scheduler.load_state_dict(_fit_groups(_load(checkpoint / "scheduler.pt"),
                                                         len(trainer.optimizer.param_groups)))
        if (checkpoint / "scaler.pt").is_file() and getattr(acc, "scaler", None) is not None:
            acc.scaler.load_state_dict(_load(checkpoint / "scaler.pt"))
    loaded = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    loaded.is_local_process_zero = trainer.state.is_local_process_zero
    loaded.is_world_process_zero = trainer.state.is_world_process_zero
    trainer.state = loaded
    if trainer.args.restore_callback_states_from_checkpoint:
        for cb in trainer.callback_handler.callbacks:
            saved = loaded.stateful_callbacks.get(type(cb).__name__)
            if saved and hasattr(cb, "state"):
                for key, value in saved.get("attributes", {}).items():
                    setattr(cb, key, value)
    rng = rng_state_file(checkpoint, acc.process_index, acc.num_processes)
    if rng is not None:
        _set_rng_state(_load(rng))


def rng_state_file(checkpoint: Path, rank: int, num_processes: int) -> Path | None:
    """This rank's RNG file: its own ``rng_state_<rank>.pth``, else the single-process one.

    A run resumed on fewer or more processes than saved it restores what exists (rank 0's
    streams on one process) and warns that the random draws differ from the original run.
    """
    own = checkpoint / f"rng_state_{rank}.pth"
    single = checkpoint / "rng_state.pth"
    saved_ranks = len(list(checkpoint.glob("rng_state_*.pth")))
    if saved_ranks and saved_ranks != num_processes or (not saved_ranks and num_processes > 1 and single.is_file()):
        if rank == 0:
            log.warning("%s was saved by %d process(es) and resumes on %d: data order and losses carry on, "
                        "but random draws (dropout) differ from the original run", checkpoint.name,
                        saved_ranks or 1, num_processes)
    for path in (own, single, checkpoint / "rng_state_0.pth"):
        if path.is_file():
            return path
    return None


def load_best_model(trainer: "Trainer") -> None:
    """Load the weights of ``state.best_model_checkpoint`` into the model (load_best_model_at_end)."""
    path = Path(trainer.state.best_model_checkpoint)
    if not path.is_dir():
        log.warning("best checkpoint %s is gone; keeping the final weights", path)
        return
    _load_weights(trainer, path)
