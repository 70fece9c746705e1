"""TOML text helpers for the config loader: where each key is written, and values in messages.

``tomllib`` returns plain dicts without positions, yet a config error is only useful when it
points at a line. This scanner walks the text once (after ``tomllib`` accepted it, so it may
assume valid TOML) and records where each table header and each key appears: headers
(``[a.b]``, ``[[a]]``), bare/quoted/dotted keys, and keys inside inline tables
(``train = { path = "json" }`` puts ``train.path`` on the line of ``path``). Values are
skipped with their full syntax (multi-line strings and arrays), so text inside a string is
never mistaken for a key.
"""

from __future__ import annotations

import bisect
import enum
import json
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["decode_error", "describe_type", "find_lines", "kind_of", "line_of", "toml_repr", "tomlable"]

_BARE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
Path = tuple[str, ...]


def find_lines(text: str) -> dict[Path, int]:
    """Return ``{("training", "learning_rate"): 7, ...}`` for every header and key in ``text``.

    The first occurrence wins (relevant for ``[[array]]`` tables). Parents of dotted keys
    and nested headers are recorded at the first line that mentions them. Never raises: on
    text it cannot follow it returns what it found so far.
    """
    scanner = _Scanner(text)
    try:
        scanner.document()
    except (IndexError, ValueError):
        pass
    return scanner.lines


def line_of(lines: dict[Path, int], path: Path) -> int | None:
    """The line of ``path``, else of its nearest written ancestor (e.g. its table header)."""
    for end in range(len(path), 0, -1):
        if path[:end] in lines:
            return lines[path[:end]]
    return None


class _Scanner:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0
        self.lines: dict[Path, int] = {}
        self._newlines = [k for k, ch in enumerate(text) if ch == "\n"]

    # -- helpers ---------------------------------------------------------------------------

    def line(self) -> int:
        return bisect.bisect_left(self._newlines, self.i) + 1

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.s[j] if j < len(self.s) else ""

    def record(self, path: Path, line: int) -> None:
        for end in range(1, len(path) + 1):
            self.lines.setdefault(path[:end], line)

    def skip_spaces(self) -> None:
        while self.peek() in (" ", "\t") and self.peek():
            self.i += 1

    def skip_blank(self) -> None:
        """Skip whitespace, newlines and comments (between statements and array items)."""
        while self.i < len(self.s):
            ch = self.s[self.i]
            if ch in " \t\r\n":
                self.i += 1
            elif ch == "#":
                end = self.s.find("\n", self.i)
                self.i = len(self.s) if end < 0 else end
            else:
                return

    # -- grammar ---------------------------------------------------------------------------

    def document(self) -> None:
        table: Path = ()
        while True:
            self.skip_blank()
            if self.i >= len(self.s):
                return
            line = self.line()
            if self.peek() == "[":
                double = self.peek(1) == "["
                self.i += 2 if double else 1
                table = self.key()
                self.skip_spaces()
                self.i += 2 if double else 1
                self.record(table, line)
            else:
                key = self.key()
                self.skip_spaces()
                self.i += 1  # "="
                self.record(table + key, line)
                self.value(table + key)

    def key(self) -> Path:
        parts: list[str] = []
        while True:
            self.skip_spaces()
            ch = self.peek()
            if ch in ('"', "'"):
                start = self.i
                self.string()
                parts.append(tomllib.loads("k = " + self.s[start:self.i])["k"])
            else:
                start = self.i
                while self.peek() in _BARE and self.peek():
                    self.i += 1
                if start == self.i:
                    raise ValueError("not a key")
                parts.append(self.s[start:self.i])
            self.skip_spaces()
            if self.peek() != ".":
                return tuple(parts)
            self.i += 1

    def string(self) -> None:
        quote = self.peek()
        if self.s.startswith(quote * 3, self.i):
            end = self.i + 3
            while True:
                end = self.s.index(quote * 3, end)
                if quote == '"' and _escaped(self.s, end):
                    end += 1
                    continue
                break
            end += 3
            while self.s[end:end + 1] == quote:  # up to two quotes may close the content
                end += 1
            self.i = end
            return
        end = self.i + 1
        while True:
            end = self.s.index(quote, end)
            if quote == '"' and _escaped(self.s, end):
                end += 1
                continue
            break
        self.i = end + 1

    def value(self, path: Path) -> None:
        self.skip_spaces()
        ch = self.peek()
        if ch in ('"', "'"):
            self.string()
        elif ch == "[":
            self.i += 1
            index = 0
            while True:
                self.skip_blank()
                if self.peek() == "]":
                    self.i += 1
                    return
                self.value(path + (str(index),))
                index += 1
                self.skip_blank()
                if self.peek() == ",":
                    self.i += 1
        elif ch == "{":
            self.i += 1
            while True:
                self.skip_spaces()
                if self.peek() == "}":
                    self.i += 1
                    return
                line = self.line()
                key = self.key()
                self.skip_spaces()
                self.i += 1  # "="
                self.record(path + key, line)
                self.value(path + key)
                self.skip_spaces()
                if self.peek() == ",":
                    self.i += 1
        else:
            while self.peek() and self.peek() not in ",]}\n#":
                self.i += 1


def _escaped(s: str, pos: int) -> bool:
    """Whether the character at ``pos`` is preceded by an odd number of backslashes."""
    count = 0
    while pos - count - 1 >= 0 and s[pos - count - 1] == "\\":
        count += 1
    return count % 2 == 1


# -- TOML values in messages and files ----------------------------------------------------


def decode_error(exc: tomllib.TOMLDecodeError) -> tuple[str, int | None]:
    """``(message, line)`` of a tomllib error; tomllib puts the position in the text only."""
    message, line = getattr(exc, "msg", None) or str(exc), getattr(exc, "lineno", None)
    match = re.search(r"\s*\(at line (\d+), column (\d+)\)$", message)
    if match:
        message, line = f"{message[:match.start()]} (column {match.group(2)})", int(match.group(1))
    return re.sub(r"\s*\(at end of document\)$", " (at the end of the file)", message), line


def toml_repr(value: Any) -> str:
    """A short TOML-looking rendering of a value, for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_repr(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_repr(v)}" for k, v in value.items()) + " }"
    return repr(value)


def kind_of(value: Any) -> str:
    """What a value is, in TOML words: "a string", "an integer", "a table"."""
    kinds = ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
             (list, "a list"), (tuple, "a list"), (dict, "a table"))
    return next((name for cls, name in kinds if isinstance(value, cls)), f"a {type(value).__name__}")


def tomlable(value: Any) -> Any:
    """Drop None (TOML has no null) and turn paths/enums/tuples into TOML types."""
    if isinstance(value, dict):
        return {str(k): tomlable(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [tomlable(v) for v in value if v is not None]
    if isinstance(value, enum.Enum):
        return value.value
    return str(value) if isinstance(value, os.PathLike) else value


def describe_type(tp: Any) -> str:
    """Say what a type hint accepts, in TOML words: ``int | None`` -> "an integer"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any value"
    if origin in (typing.Union, types.UnionType):
        if Any in args:
            return "any value"
        # A str enum beside str (HF's "SchedulerType | str") is just "a string" in a file.
        kept = [a for a in args if a is not type(None) and not any(
            a is not b and isinstance(a, type) and isinstance(b, type) and issubclass(a, b) for b in args)]
        return " or ".join(dict.fromkeys(describe_type(a) for a in kept))
    if origin in (list, tuple, set, frozenset, Sequence):
        plural = {str: "strings", int: "integers", float: "numbers", bool: "booleans"}
        return f"a list of {plural.get(args[0], describe_type(args[0]))}" if args else "a list"
    if origin is typing.Literal:
        return "one of: " + ", ".join(toml_repr(a) for a in args)
    if tp is dict or origin in (dict, Mapping):
        return "a table"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of: " + ", ".join(toml_repr(e.value) for e in tp)
    simple = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return simple.get(tp, getattr(tp, "__name__", str(tp)))
