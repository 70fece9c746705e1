"""Damage done on purpose: a flipped byte that only a hash can tell, and a digest of a folder
to prove that nothing in it changed."""

from __future__ import annotations

import hashlib
from pathlib import Path


def flip_byte(path: Path, offset: int = -8) -> None:
    """Flip the bits of one byte of ``path`` (near its end unless ``offset`` says where): the
    size stays the same, so only a hash tells the file changed."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and its sha256: what "nothing changed" compares."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}
