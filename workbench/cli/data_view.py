"""``workbench data CONFIG --show N``: a config's train rows as the model will see them.

The data is loaded and prepared exactly as ``workbench run`` prepares it (the same
``[data]`` code), but kept in memory: nothing is written into output_dir, so the view can be
run before a run, next to a live one, or on a finished one. Each row is printed decoded, with
the tokens that are trained on (labels other than -100) marked, so a wrong chat template or
a prompt that eats ``max_length`` shows at a glance; a summary says how much is trained.
Problems are one line and exit 2, as for ``workbench run``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from workbench.cli.train import load_run_config
from workbench.cli.usage import UsageError
from workbench.core.exit_codes import EXIT_OK

__all__ = ["marked_text", "row_groups", "run_data_view"]

IGNORE_INDEX = -100
_TTY_ON, _TTY_OFF = "\x1b[7;32m", "\x1b[0m"  # reverse video, green: visible on dark and light terminals


def run_data_view(ns: argparse.Namespace) -> int:
    """Print the first ``ns.show`` train rows of ``ns.config`` with trained tokens marked, and a summary."""
    if ns.show < 0:
        raise UsageError(f"--show: expected a number of rows (0 or more), got {ns.show}")
    run = load_run_config(ns)
    train, tokenizer, where = _train_rows(ns, run)
    tty = sys.stdout.isatty()
    if not hasattr(train, "__len__"):  # a streamed data set: what is shown is all that is read
        rows = [_row_values(row) for _, row in zip(range(ns.show), train)]
    else:
        rows = [_row_values(train[i]) for i in range(min(ns.show, len(train)))]
    if rows and rows[0][0] is None:
        columns = ", ".join(getattr(train, "column_names", None) or []) or "none"
        raise UsageError(f"{ns.config}: {where} has no input_ids to show (columns: {columns}); set data.text_column "
                         'or data.format = "messages" / "prompt-completion"')
    print(f"{where} of {ns.config}: the tokens trained on are {marked_text('marked', tty)}")
    for index, (ids, trained, label) in enumerate(rows):
        extra = f", label {label}" if label is not None else ""
        print(f"\n-- row {index}: {len(ids)} tokens, {sum(trained)} trained{extra}")
        print(marked_text_of(tokenizer, ids, trained, tty))
    print()
    print(_summary(train if hasattr(train, "__len__") else None, rows, where))
    return EXIT_OK


def _train_rows(ns: argparse.Namespace, run: Any) -> tuple[Any, Any, str]:
    """(train data set, tokenizer, its name): prepared in memory; problems as one-line usage errors."""
    from workbench.data.file_errors import DataFileError

    data = run.data
    try:
        if data.builtin is not None:
            from workbench.data.builtin import builtin_tokenizer, load_builtin_data

            train, _ = load_builtin_data(data.builtin, **data.options)
            return train, builtin_tokenizer(data.builtin), f"data.builtin {data.builtin!r}"
        from workbench.data.datasets_io import load_run_data

        loaded = load_run_data(run, progress=False, cache=False)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:  # as workbench run says them
        raise UsageError(str(exc) if isinstance(exc, DataFileError) else f"{ns.config}: {exc}") from None
    return loaded.train, loaded.tokenizer, "data.train"


def _as_list(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


def _row_values(row: Any) -> tuple[list[int] | None, list[bool], Any]:
    """(input ids, which are trained, a scalar label) of one row.

    Token labels mark what is trained (-100: not); without labels a causal LM's collator
    trains every token; a scalar label (classification) trains none of them.
    """
    if not isinstance(row, dict) or "input_ids" not in row:
        return None, [], None
    ids = [int(t) for t in _as_list(row["input_ids"])]
    labels = _as_list(row.get("labels", row.get("label")))
    if isinstance(labels, list) and len(labels) == len(ids):
        return ids, [int(x) != IGNORE_INDEX for x in labels], None
    if labels is None:
        return ids, [True] * len(ids), None
    return ids, [False] * len(ids), labels


def row_groups(ids: list[int], trained: list[bool]) -> Iterator[tuple[bool, list[int]]]:
    """Runs of consecutive tokens that are all trained or all not: (trained, ids)."""
    start = 0
    for at in range(1, len(ids) + 1):
        if at == len(ids) or trained[at] != trained[start]:
            yield trained[start], ids[start:at]
            start = at


def marked_text(text: str, tty: bool) -> str:
    """``text`` marked as trained: reverse green on a terminal, ``[[text]]`` in a file or pipe."""
    return f"{_TTY_ON}{text}{_TTY_OFF}" if tty else f"[[{text}]]"


def marked_text_of(tokenizer: Any, ids: list[int], trained: list[bool], tty: bool) -> str:
    """The row decoded group by group, the trained groups marked."""
    def decode(group: list[int]) -> str:
        if tokenizer is None:
            return " ".join(map(str, group))
        return tokenizer.decode(group)

    return "".join(marked_text(decode(group), tty) if on else decode(group) for on, group in row_groups(ids, trained))


def _counts(train: Any, shown: list[tuple[list[int] | None, list[bool], Any]]) -> Iterable[tuple[int, int]]:
    """(tokens, trained tokens) of every row (of the shown rows for a streamed data set)."""
    if train is None:
        return [(len(ids or []), sum(on)) for ids, on, _ in shown]
    columns = getattr(train, "column_names", None)
    if columns is not None:  # a datasets.Dataset: read the columns, not row dicts
        labels = train["labels"] if "labels" in columns else None
        out = []
        for k, ids in enumerate(train["input_ids"]):
            row = {"input_ids": ids} if labels is None else {"input_ids": ids, "labels": labels[k]}
            ids_, on, _ = _row_values(row)
            out.append((len(ids_ or []), sum(on)))
        return out
    return [(len(ids or []), sum(on)) for ids, on, _ in (_row_values(train[i]) for i in range(len(train)))]


def _summary(train: Any, shown: list, where: str) -> str:
    counts = list(_counts(train, shown))
    rows = len(counts)
    if not rows:
        return f"{where}: no rows"
    tokens = sum(c[0] for c in counts)
    trained = sum(c[1] for c in counts)
    share = f"{100 * trained / tokens:.1f}%" if tokens else "0%"
    scope = "" if train is not None else " (the rows shown; the data is streamed)"
    return (f"{where}: {rows} rows{scope}, {tokens / rows:.1f} tokens a row on average, {trained / rows:.1f} "
            f"trained ({share} of the tokens)")
