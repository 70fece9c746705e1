"""The checkpoint store of an output_dir: atomic publish, a cheap catalog, verification, rotation.

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
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any


from workbench.core.names import MANIFEST, PREFIX_CHECKPOINT_DIR, SENTINEL, WEIGHTS, WEIGHTS_INDEX, WORKBENCH_STATE_NAME
from workbench.core.records import ROW_EDITS, CheckpointRow

if TYPE_CHECKING:
    pass

log = logging.getLogger("workbench")

__all__ = ["CheckpointStore", "MANIFEST", "SENTINEL", "WEIGHTS", "WEIGHTS_INDEX", "refused_text"]

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


class CheckpointStore:
    """The checkpoints of one output directory."""

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.root = Path(output_dir)

    # -- writing -------------------------------------------------------------------------

    def publish(self, step: int, write: Callable[[Path], None], expected_size: int | None = None) -> Path:
        """Have ``write`` fill a temporary folder, seal it with a manifest, rename it in place.

        ``expected_size`` (bytes, about) is what a failure for want of space reports."""
        return self.seal(step, self.begin(step, expected_size), write, expected_size)

    def temporary(self, step: int) -> Path:
        """The folder a checkpoint of ``step`` is written into before it is published."""
        return self.root / f".tmp-{PREFIX_CHECKPOINT_DIR}-{step}"

    def begin(self, step: int, expected_size: int | None = None) -> Path:
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
            raise self._write_failed(final.name, tmp, exc, expected_size) from exc
        return tmp

    def _write_failed(self, name: str, tmp: Path, exc: BaseException, expected_size: int | None) -> OSError:
        """The one-line error for a save that failed on the storage, once its partial folder
        is gone (a full disk is measured before that, while it is still full)."""
        from workbench.checkpoint.storage_errors import classify, write_error

        code = classify(exc, self.root, expected_size)
        shutil.rmtree(tmp, ignore_errors=True)
        if expected_size is None:  # a library caller: the last checkpoint's size says about as much
            sizes = [row.size for row in self.list() if row.complete]
            expected_size = sizes[-1] if sizes else None
        earlier = [row.name for row in self.list() if row.complete]
        return write_error(name, self.root, tmp, exc, code, expected_size, earlier)

    def seal(self, step: int, tmp: Path, write: Callable[[Path], None] | None = None,
             expected_size: int | None = None) -> Path:
        """Run ``write`` into ``tmp``, then checksum everything in it and publish it atomically.

        Other ranks' files must be in ``tmp`` before this is called (they are hashed too).
        A failure of the storage (a full disk, a quota, a read-only folder) removes ``tmp``
        and raises a CheckpointWriteError that says so in one line (storage_errors.py).
        """
        from workbench.checkpoint.storage_errors import is_storage_failure

        final = self.root / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        try:
            if write is not None:
                write(tmp)
            (tmp / SENTINEL).unlink()
            _write_manifest(tmp, step)
        except Exception as exc:
            # Nothing published before is touched, whatever failed: only the half-written
            # folder goes.
            if not is_storage_failure(exc):
                shutil.rmtree(tmp, ignore_errors=True)
                raise  # not a storage problem: a bug shows its own traceback
            raise self._write_failed(final.name, tmp, exc, expected_size) from exc
        if final.exists():
            # Re-saving a step (e.g. save at the end after a save at the same step): move the
            # old copy aside and delete it only once the new one is published. One that fails
            # verification (a run resumed from an older checkpoint past a damaged one) is kept
            # under another name: its data may still be worth recovering.
            ok, why = self.verify(final)
            aside = final.with_name(f".trash-{final.name}-{time.time_ns()}" if ok else
                                    f"{final.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(final, aside)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            if ok:
                shutil.rmtree(aside, ignore_errors=True)
            else:
                log.warning("%s failed verification (%s): kept as %s, not overwritten", final.name,
                            why.split(" (changed after")[0], aside.name)
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
        # A checkpoint that fails verification (sizes: cheap) is neither counted nor deleted:
        # it is the user's to inspect, and nothing saved is deleted unasked.
        complete = [c for c in self.list() if c.complete and self.verify(c.path, hashes=False)[0]]
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

    def list(self) -> list[CheckpointRow]:
        """The catalog, oldest first. Cheap: reads small JSON files, hashes nothing."""
        if not self.root.is_dir():
            return []
        rows = []
        best_by_step: dict[int, str] = {}
        for path in self.root.iterdir():
            match = _NAME.match(path.name)
            if not match or not path.is_dir():
                continue
            row, best = self._read_row(path, int(match.group(1)))
            if best:
                best_by_step[row.step] = best
            rows.append(row)
        rows.sort(key=lambda r: r.step)
        # The newest checkpoint's trainer_state knows the best one (older ones knew less).
        best_name = Path(best_by_step[max(best_by_step)]).name if best_by_step else None
        newest_complete = max((r.step for r in rows if r.complete), default=None)
        return [replace(row, best=row.name == best_name,
                        protected=row.name == best_name or row.step == newest_complete) for row in rows]

    def _read_row(self, path: Path, step: int) -> tuple[CheckpointRow, str | None]:
        """One checkpoint's catalog row, and the best checkpoint its trainer_state names."""
        info: dict[str, Any] = {"name": path.name, "path": str(path), "step": step, "metrics": {}}
        manifest = path / MANIFEST
        info["complete"] = manifest.is_file()
        best = None
        try:
            if info["complete"]:
                data = json.loads(manifest.read_text(encoding="utf-8"))
                info["created"] = data.get("created")
                info["size"] = sum(f["size"] for f in data["files"].values())
            else:
                info["size"] = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
            extras = path / WORKBENCH_STATE_NAME
            if extras.is_file():
                state.update(json.loads(extras.read_text(encoding="utf-8")))
            edits = list(state.get("live_edits") or [])
            info["edits"], info["edit_count"] = edits[-ROW_EDITS:], len(edits)
            # HF writes no manifest, no sentinel and no workbench_state.json.
            info["foreign"] = (not info["complete"] and not (path / SENTINEL).exists()
                               and not extras.exists() and _looks_like_hf(path))
            info["epoch"] = state.get("epoch")
            best = state.get("best_model_checkpoint") or None
            for entry in state.get("log_history", []):
                if entry.get("step") == step:
                    info["metrics"].update({k: v for k, v in entry.items()
                                            if k.startswith("eval_") and isinstance(v, (int, float))})
        except (OSError, ValueError, KeyError) as exc:
            info["problem"] = f"unreadable: {exc}"
            info["complete"] = False
        return CheckpointRow(**info), best

    def verify(self, path: str | os.PathLike, hashes: bool = True) -> tuple[bool, str | None]:
        """Check every file against the manifest: sizes, and sha256 unless ``hashes`` is False
        (a quick structural check before any work; loading verifies the hashes)."""
        path = Path(path)
        differences, why = self.differences(path, hashes=hashes)
        if why is not None:
            return False, why
        if differences:
            rel, what = differences[0]
            return False, (f"{rel} {what} (changed after the checkpoint was sealed?); if the change is intended, "
                           f"accept it with 'workbench checkpoints {self.root} --reseal {path.name}'")
        return True, None

    def differences(self, path: str | os.PathLike, hashes: bool = True) -> tuple[list[tuple[str, str]], str | None]:
        """(file, what differs) for each file that no longer matches the manifest, and a reason
        when there is no readable manifest at all. Files added since sealing count too."""
        path = Path(path)
        manifest = path / MANIFEST
        if not manifest.is_file():
            return [], "no manifest.json (the save did not finish)"
        try:
            files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        except (ValueError, KeyError) as exc:
            return [], f"manifest.json is unreadable ({exc})"
        out: list[tuple[str, str]] = []
        for rel, meta in files.items():
            target = path / rel
            if not target.is_file():
                out.append((rel, "is missing"))
            elif target.stat().st_size != meta["size"]:
                out.append((rel, f"has {target.stat().st_size} bytes, the manifest says {meta['size']}"))
            elif hashes and _sha256(target) != meta["sha256"]:
                out.append((rel, "does not match its sha256"))
        for extra in sorted(p for p in path.rglob("*") if p.is_file()):
            rel = extra.relative_to(path).as_posix()
            if rel != MANIFEST and rel not in files:
                out.append((rel, "is not in the manifest (added after sealing)"))
        return out, None

    def reseal(self, path: str | os.PathLike) -> list[tuple[str, str]]:
        """Accept a checkpoint's files as they are now (e.g. weights resharded by a script):
        rewrite its manifest atomically; returns what differed from the old one."""
        path = Path(path)
        differences, why = self.differences(path)
        if why is not None and not (path / "trainer_state.json").is_file():
            raise ValueError(f"{path}: {why}, and it has no trainer_state.json: not a checkpoint")
        _write_manifest(path, _step_of(path))
        return differences

    def structural_check(self, path: str | os.PathLike) -> tuple[bool, str | None]:
        """For a checkpoint without a manifest (one transformers' Trainer wrote): every file HF
        writes for a resume is there, and each loads with ``torch.load(weights_only=True)``."""
        path = Path(path)
        if path.name.startswith(".tmp-") or (path / SENTINEL).exists():
            return False, "its save did not finish (a temporary folder)"
        if not _looks_like_hf(path):
            return False, ("no manifest.json, and not laid out as a transformers checkpoint "
                           "(trainer_state.json plus model weights)")
        try:
            json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return False, f"trainer_state.json is unreadable ({exc})"
        if (path / "optimizer.pt").is_file() != (path / "scheduler.pt").is_file():
            return False, "it has one of optimizer.pt / scheduler.pt without the other"
        from workbench.core.rng import numpy_safe_globals
        import torch

        for name in sorted(p.name for p in path.iterdir() if p.suffix in (".pt", ".pth")):
            try:
                with numpy_safe_globals():
                    torch.load(path / name, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # noqa: BLE001 - any failure means: not loadable safely
                return False, f"{name} does not load with weights_only=True ({str(exc).splitlines()[0]})"
        return True, None

    def latest_verified(self) -> CheckpointRow | None:
        """The newest checkpoint whose manifest verifies; newer ones skipped are logged by name."""
        info, refused = self.newest_usable()
        if info is not None:
            for name, why in refused:
                log.warning("skipping %s: %s", name, why)
        return info

    def newest_usable(self) -> tuple[CheckpointRow | None, list[tuple[str, str]]]:
        """The newest checkpoint whose manifest verifies, and (name, why) for each newer one
        that does not. Checkpoints transformers' Trainer wrote (no manifest) are taken by
        resolve_resume only when nothing sealed exists (foreign_fallback), so they are passed
        over here. Logs nothing: the caller says what it does with the answer."""
        refused: list[tuple[str, str]] = []
        for info in reversed(self.list()):
            if info.foreign:
                continue
            problem = self.problem(info.path) if info.complete else (info.problem or "incomplete (no manifest.json)")
            if problem is None:
                return replace(info, verified=True), refused
            refused.append((info.name, problem))
        return None, refused

    def problem(self, path: str | os.PathLike) -> str | None:
        """What makes a checkpoint fail verification, in a few words (None: it verifies)."""
        differences, why = self.differences(path)
        if why is not None:
            return why
        return " and ".join(f"{rel} {what}" for rel, what in differences[:2]) if differences else None

    def resolve_resume(self, resume: str | bool | os.PathLike) -> Path:
        """The checkpoint folder for ``resume_from_checkpoint`` (True: newest verified).

        A checkpoint written by transformers' Trainer (no manifest) is taken after a structural
        check, with a warning that it is unverified: when named, or for True when no sealed
        checkpoint exists in the output_dir.
        """
        if resume is True:
            info = self.latest_verified()
            if info is not None:
                return Path(info.path)
            refused = self.newest_usable()[1]
            foreign = self.foreign_fallback()
            if foreign is not None:
                return self._unverified(foreign)
            damaged = "; none verifies: " + refused_text(refused) if refused else ""
            raise ValueError(f"No valid checkpoint found in output directory ({self.root}){damaged}")
        try:
            path = self.named(resume)
        except LookupError as exc:
            raise ValueError(f"resume_from_checkpoint: {exc}") from None
        if not path.is_dir():
            raise ValueError(f"resume_from_checkpoint: {path} is not a checkpoint folder")
        if not (path / MANIFEST).is_file():
            ok, why = self.structural_check(path)
            if not ok:
                raise ValueError(f"resume_from_checkpoint: {path} cannot be used: {why}")
            return self._unverified(path)
        ok, why = self.verify(path)
        if not ok:
            raise ValueError(f"resume_from_checkpoint: {path} cannot be used: {why}")
        return path

    def foreign_fallback(self) -> Path | None:
        """The newest checkpoint transformers' Trainer wrote that passes the structural check,
        when nothing sealed (with a manifest) exists here at all; else None."""
        rows = self.list()
        if any(row.complete for row in rows):
            return None
        for candidate in reversed(rows):
            if candidate.foreign and self.structural_check(candidate.path)[0]:
                return Path(candidate.path)
        return None

    def named(self, resume: str | os.PathLike) -> Path:
        """The folder ``resume`` names: the path itself when it exists, else a bare checkpoint
        name (``checkpoint-88``, as ``workbench checkpoints`` prints it) inside this output_dir.
        An unknown bare name is a LookupError listing the complete checkpoints there."""
        path = Path(resume)
        if path.exists() or len(path.parts) != 1:
            return path
        inside = self.root / path
        if inside.is_dir():
            return inside
        names = [row.name for row in self.list() if row.complete]
        listed = ", ".join(names) if names else "none"
        raise LookupError(f"{path} is neither a folder nor a checkpoint of {self.root} (its complete "
                          f"checkpoints: {listed})")

    @staticmethod
    def _unverified(path: Path) -> Path:
        log.warning("%s has no manifest.json (written by transformers' Trainer?): resuming from it unverified; "
                    "its files passed a structural check only", path)
        return path


def refused_text(refused: list[tuple[str, str]], limit: int = 3) -> str:
    """``checkpoint-6 (why), checkpoint-4 (why)``: the checkpoints that failed verification,
    newest first, at most ``limit`` named."""
    text = ", ".join(f"{name} ({why})" for name, why in refused[:limit])
    return text + (f" and {len(refused) - limit} more" if len(refused) > limit else "")


def _write_manifest(folder: Path, step: int) -> None:
    """Fsync every file of ``folder`` and write its manifest (sizes, sha256) last, atomically."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {"format": 1, "step": step, "created": time.time(), "files": files}
    tmp = folder / f".{MANIFEST}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    _fsync_dir(folder)


def _looks_like_hf(path: Path) -> bool:
    """trainer_state.json plus weights in one of the layouts transformers writes."""
    weights = (path / WEIGHTS).is_file() or (path / WEIGHTS_INDEX).is_file() or (path / "adapter_model.safetensors").is_file()
    return (path / "trainer_state.json").is_file() and weights


def _step_of(path: Path) -> int:
    match = _NAME.match(path.name)
    if match:
        return int(match.group(1))
    return int(json.loads((path / "trainer_state.json").read_text(encoding="utf-8")).get("global_step", 0))
