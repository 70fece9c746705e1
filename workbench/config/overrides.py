"""Overrides of a config: ``--set KEY=VALUE`` on the command line, ``overrides=`` in Python,
and the ``key=value`` pairs a branch or a form types. Each value is read as TOML (numbers,
booleans, arrays, quoted strings), else taken as plain text."""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from workbench.config.errors import ConfigError, Key
from workbench.config.toml_lines import toml_repr

__all__ = ["parse_override", "parse_overrides", "apply_overrides"]


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``"training.learning_rate=1e-4"`` into the dotted key and its value.

    The value is read as a TOML value (numbers, booleans, arrays, quoted strings); text that
    is not valid TOML is taken as a plain string, so ``run_name=my-run`` needs no quotes.
    """
    key, sep, value_text = text.partition("=")
    key, value_text = key.strip(), value_text.strip()
    if not sep or not key:
        raise ConfigError("expected KEY=VALUE (e.g. training.learning_rate=1e-4)", path=f"--set {text}")
    try:
        parsed = tomllib.loads(f"v = {value_text}")
        value = parsed["v"] if len(parsed) == 1 else value_text
    except tomllib.TOMLDecodeError:
        value = value_text
    return key, value


def parse_overrides(text: str | Mapping[str, str]) -> dict[str, Any]:
    """Typed-in overrides of one run's TrainingArguments (a branch) as a dict.

    ``text`` is ``"warmup_steps=10, training.lr_scheduler_type=linear"`` (comma- or
    line-separated KEY=VALUE pairs), or a mapping of key to the text of one value (form
    fields; empty ones are left out). Each value is read as :func:`parse_override` reads
    it (TOML, else plain text); a leading ``training.`` is dropped. Check the result with
    :func:`check_training_overrides`. Raises ConfigError on a pair without ``=``.
    """
    if isinstance(text, Mapping):
        pairs = [(str(key), str(value).strip()) for key, value in text.items() if str(value).strip()]
        parsed = [(key, parse_override(f"{key}={value}")[1]) for key, value in pairs]
    else:
        parsed = []
        for part in (p.strip() for p in text.replace("\n", ",").split(",")):
            if not part:
                continue
            if "=" not in part:
                raise ConfigError(f"{part!r}: expected key=value (e.g. warmup_steps=10)")
            parsed.append(parse_override(part))
    return {key.strip().removeprefix("training."): value for key, value in parsed}


def apply_overrides(data: dict, overrides: Sequence[str] | Mapping[str, Any] | None) -> tuple[dict, dict[Key, str]]:
    """Apply overrides to a copy of ``data``; also return which key each override set."""
    data, origins = copy.deepcopy(data), {}
    if isinstance(overrides, Mapping):
        items = [(str(k), v, f"{k}={toml_repr(v)}") for k, v in overrides.items()]
    else:
        texts = [overrides] if isinstance(overrides, str) else list(overrides or ())
        items = [(*parse_override(t), t) for t in texts]
    for key, value, text in items:
        parts = tuple(p.strip() for p in key.split("."))
        if not all(parts):
            raise ConfigError("expected a dotted key such as training.learning_rate", path=f"--set {text}")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"is not a table, so it has no key {parts[i + 1]!r}",
                                  path=f"--set {text}", key=".".join(parts[:i + 1]))
            node = child
        if value is None:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = value
        origins[parts] = text
    return data, origins
