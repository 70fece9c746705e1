"""Locate a problem found after the config was checked: a model or data set refusing its
options when it is built (``n_embd (128) must be divisible by n_head (3)``) names no key,
yet the key is in the file, or came from ``--set``. The error is told where it is."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from workbench.config.errors import ConfigError
from workbench.config.overrides import apply_overrides
from workbench.config.toml_lines import find_lines, line_of

__all__ = ["locate_build_error"]

# The tables whose options go to a builder as keyword arguments: a message naming one of them is theirs.
_OPTION_TABLES = (("model", "options"), ("data", "options"), ("model",))


def _mentioned(message: str, raw: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """The option keys ``message`` names as words, in the order it names them."""
    found: list[tuple[int, tuple[str, ...]]] = []
    for table in _OPTION_TABLES:
        node: Any = raw
        for part in table:
            node = node.get(part, {}) if isinstance(node, Mapping) else {}
        for name, value in (node.items() if isinstance(node, Mapping) else ()):
            if isinstance(value, Mapping):
                continue
            match = re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", message)
            if match is not None:
                found.append((match.start(), (*table, name)))
    return [key for _, key in sorted(found)]


def locate_build_error(message: str, config_path: str | Path, shown: str,
                       overrides: Sequence[str] | None = None) -> str:
    """``message`` located at the first option key it names: ``c.toml:12: model.options.n_head:
    message`` for a key of the file, ``--set model.options.n_head=3: ...`` for an override (an
    override a message names wins over the file's keys); ``shown: message`` when it names none."""
    try:
        text = Path(config_path).read_text(encoding="utf-8")
        import tomllib

        raw, origins = apply_overrides(tomllib.loads(text), overrides)
    except (OSError, ValueError, ConfigError):
        return f"{shown}: {message}"
    keys = _mentioned(message, raw)
    if not keys:
        return f"{shown}: {message}"
    overridden = [key for key in keys if key in origins]
    if overridden:
        return str(ConfigError(message, path=f"--set {origins[overridden[0]]}"))
    lines = find_lines(text)
    key, others = keys[0], keys[1:]
    also = "; ".join(f"{'.'.join(k)} is on line {line_of(lines, k)}" for k in others if line_of(lines, k))
    return str(ConfigError(message + (f" ({also})" if also else ""), path=shown, line=line_of(lines, key),
                           key=".".join(key)))
