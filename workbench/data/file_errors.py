"""Say which file, and which line of it, broke a data load: ``data/train.jsonl:17: not valid JSON``.

``datasets`` reports a broken local file as a chain of five exceptions (pyarrow's "JSON
parse error ... in row 16", pandas' "Expected 2 fields in line 4, saw 3", or a bare
StopIteration for an empty file) under "An error occurred while generating the dataset".
Only once a load has failed are the local files it read looked at again here, line by
line, to find the first bad one: a good load costs nothing extra.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["DataFileError", "causes", "check_rows", "explain_failure", "local_files", "no_rows", "shown"]

_PANDAS_RAGGED = re.compile(r"Expected (\d+) fields in line (\d+), saw (\d+)")


class DataFileError(ValueError):
    """A local data file cannot be used; ``str()`` is one line that starts with the file
    (and the line, where one is to blame)."""


def shown(path: str | os.PathLike) -> str:
    """``path`` as the user would type it: relative to the working folder when inside it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def local_files(path: str, data_files: Any) -> list[Path]:
    """The local files a ``load_dataset(path, data_files=...)`` call reads (globs expanded)."""
    found: list[Path] = []

    def add(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                add(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)
        elif isinstance(value, str) and "://" not in value:
            if any(ch in value for ch in "*?["):
                import glob

                found.extend(Path(p) for p in sorted(glob.glob(value)) if os.path.isfile(p))
            elif os.path.isfile(value):
                found.append(Path(value))

    add(data_files if data_files is not None else path)
    return found


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it was raised from (or during), outermost first."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        yield from enumerate(f, start=1)


def _first_bad_json_line(path: Path) -> str | None:
    """``FILE:N: not valid JSON (why)`` for the first line that is not a JSON object."""
    first = True
    for number, raw in _lines(path):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            return f"{shown(path)}:{number}: not valid UTF-8 (byte {exc.start + 1} of the line)"
        except ValueError as exc:
            if first:  # maybe one JSON document over many lines (datasets reads those too)
                return _json_document_error(path)
            return f"{shown(path)}:{number}: not valid JSON ({_what(exc)})"
        if not isinstance(value, dict):
            if first and isinstance(value, list):
                return None  # a whole document on one line: its contents are datasets' business
            return f"{shown(path)}:{number}: not a JSON object (a row must be {{\"column\": value, ...}})"
        first = False
    return None


def _what(exc: json.JSONDecodeError) -> str:
    return f"{exc.msg.removesuffix(' at')} at column {exc.colno}"


def _json_document_error(path: Path) -> str | None:
    try:
        json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        return f"{shown(path)}: not valid UTF-8 (byte {exc.start + 1})"
    except ValueError as exc:
        return f"{shown(path)}:{exc.lineno}: not valid JSON ({_what(exc)})"
    return None


def _first_ragged_csv_row(path: Path, delimiter: str, exc: BaseException) -> str | None:
    for link in causes(exc):
        match = _PANDAS_RAGGED.search(str(link))
        if match:
            want, line, saw = match.groups()
            return f"{shown(path)}:{line}: {saw} fields where the header has {want} (a ragged row)"
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.reader(f, delimiter=delimiter)
        header = next(reader, None)
        for row in reader:
            if header is not None and row and len(row) != len(header):
                return (f"{shown(path)}:{reader.line_num}: {len(row)} fields where the header has "
                        f"{len(header)} (a ragged row)")
    return None


def explain_failure(exc: BaseException, files: list[Path], builder: str, options: dict[str, Any]) -> str | None:
    """One line naming the file (and line) that made a load with ``builder`` fail, or None
    when the files look fine (the failure is elsewhere: say datasets' own message then)."""
    for path in files:
        try:
            with open(path, "rb") as f:
                head = f.read(65536)
            if not head.strip() and path.stat().st_size <= len(head):
                return f"{shown(path)}: the file is empty (no rows); put rows in it or name another file"
            if builder == "json":
                line = _first_bad_json_line(path)
            elif builder == "csv":
                line = _first_ragged_csv_row(path, options.get("sep") or options.get("delimiter") or ",", exc)
            else:
                line = None
        except OSError as err:
            return f"{shown(path)}: cannot be read ({err.strerror or err})"
        if line:
            return line
    return None


def no_rows(where: str, files: list[Path], split: str | None) -> str:
    """The line for a data set with no rows (an empty file, a header-only csv, an empty slice)."""
    source = ", ".join(shown(p) for p in files) if files else "the data set"
    sliced = f" in split {split!r}" if split and "[" in split else ""
    return f"{source}: no rows{sliced}; {where} needs at least one"


def check_rows(dataset: Any, where: str, files: list[Path], split: str | None) -> None:
    """Refuse a data set with no rows (an empty file, a header-only csv, an empty slice):
    a run would fail later, far from the cause, or evaluate nothing."""
    try:
        rows = len(dataset)
    except TypeError:  # an IterableDataset: its length is unknown until read
        return
    if not rows:
        raise DataFileError(no_rows(where, files, split))
