"""Chat and instruction rows (``[data] format``): tokens, the labels that train the answers only,
truncation and packing.

* ``format = "messages"``: each row has a ``messages`` list of ``{role, content}`` dicts,
  rendered with the tokenizer's chat template. With ``completion_only_loss`` the labels are
  -100 everywhere except on the assistant's answers, each with the end-of-turn text the
  template writes after it (so the model learns to stop).
* ``format = "prompt-completion"``: ``prompt`` and ``completion`` text columns; the prompt is
  tokenized with the tokenizer's special tokens, the completion without, and the eos token
  is appended (as TRL does). With ``completion_only_loss`` only the completion is trained.

Without ``completion_only_loss`` every token is trained (labels = input_ids). The Trainer
counts labels != -100 as ``num_items_in_batch``, so the loss is the mean over answer tokens.

How the answers are found in a conversation: the whole conversation is rendered as text, and
for the assistant message ``i`` its span runs from the end of the render of
``messages[:i]`` with the generation prompt to the end of the render of ``messages[:i + 1]``;
both must be prefixes of the whole text (a template that rewrites earlier turns cannot be
used this way, and says so). The text is tokenized once, and a token is trained when one of
its characters lies in a span (a fast tokenizer's offsets; a slow one tokenizes the spans
and the text between them separately). Tokenizing the whole text, not the pieces, gives
exactly the tokens the model sees at inference.

Every problem is one ValueError line naming the split and the row (its index in the data
set, as ``workbench data CONFIG --show`` numbers them). transformers is never imported here.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "chat_rows_batch",
    "check_chat_columns",
    "check_chat_tokenizer",
    "encode_messages",
    "encode_prompt_completion",
    "labeled_example",
    "pack_examples",
    "prepare_chat_dataset",
    "tokenizer_name",
]

IGNORE_INDEX = -100  # what the loss (and the Trainer's count of items) leaves out
FORMATS = ("messages", "prompt-completion")
_COLUMNS = {"messages": ("messages",), "prompt-completion": ("prompt", "completion")}
# Bumped when the tokens or labels made here change, so no stale cache is reused.
VERSION = 1

log = logging.getLogger("workbench")


def tokenizer_name(tokenizer: Any) -> str:
    """How a message names the tokenizer: its folder, or the built-in character tokenizer."""
    if _is_char(tokenizer):
        return 'the built-in "char" tokenizer'
    folder = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return f"the tokenizer in {folder}"


def _is_char(tokenizer: Any) -> bool:
    from workbench.data.builtin import CharTokenizer

    return isinstance(tokenizer, CharTokenizer)


def check_chat_columns(dataset: Any, format: str, where: str = "data.train") -> None:
    """ValueError (one line, the columns there are) unless ``dataset`` has ``format``'s columns.

    Checked for every split before any is tokenized, so a wrong file fails before a cache
    is written.
    """
    columns = list(getattr(dataset, "column_names", None) or [])
    needed = _COLUMNS[format]
    missing = [c for c in needed if c not in columns]
    if not columns or not missing:
        return
    what = ("a 'messages' column (a list of {role, content} messages)" if format == "messages"
            else "text columns 'prompt' and 'completion'")
    raise ValueError(f'{where}: format = "{format}" needs {what}; the data has no {missing[0]!r} column '
                     f"(columns: {', '.join(columns)}); rename one with data.columns = {{ old = \"{missing[0]}\" }}")


def check_chat_tokenizer(tokenizer: Any, format: str) -> None:
    """ValueError (one line) unless ``tokenizer`` can prepare ``format``: messages need a chat template."""
    if format != "messages" or (getattr(tokenizer, "chat_template", None) and not _is_char(tokenizer)):
        return
    raise ValueError(f'data.format = "messages": {tokenizer_name(tokenizer)} has no chat template; set '
                     "tokenizer.chat_template and save it (chat_template.jinja in the folder), point data.tokenizer "
                     'at a tokenizer folder that has one, or use format = "prompt-completion"')


# -- one row ---------------------------------------------------------------------------------


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _checked_messages(messages: Any, where: str) -> list[dict]:
    """The row's messages as plain dicts (keys whose value is None dropped: datasets fills in
    the keys other rows have); anything but a list of {role, content} text dicts is an error."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}} messages, "
                         f"got {_short(messages)}")
    out = []
    for i, message in enumerate(messages):
        ok = isinstance(message, dict) and isinstance(message.get("role"), str) and message["role"] \
            and isinstance(message.get("content"), str)
        if not ok:
            raise ValueError(f"{where}: message {i} is not a {{role, content}} dict with text content "
                             f"(got {_short(message)})")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def _render(tokenizer: Any, messages: list[dict], where: str, generation_prompt: bool = False) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # noqa: BLE001 - a template's raise_exception, a jinja error: said in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{where}: the chat template of {tokenizer_name(tokenizer)} failed on this "
                         f"conversation: {first}") from None
    if not isinstance(text, str):
        # A ValueError, as every data problem: workbench run says those in one line (exit 2).
        name = tokenizer_name(tokenizer)
        raise ValueError(f"{where}: the chat template of {name} did not render text")  # noqa: TRY004
    return text


def _answer_spans(tokenizer: Any, messages: list[dict], full: str, where: str) -> list[tuple[int, int]]:
    """Character spans of the assistant's answers in ``full`` (each with its end-of-turn text)."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        upto = _render(tokenizer, messages[:i + 1], where)
        if i == 0:  # no prompt to render before it: the answer starts at its content
            start = upto.find(message["content"]) if message["content"] else -1
            prompt = upto[:max(start, 0)]
        else:
            prompt = _render(tokenizer, messages[:i], where, generation_prompt=True)
            start = len(prompt)
        if start < 0 or not full.startswith(prompt) or not full.startswith(upto) or len(upto) < start:
            raise ValueError(f"{where}: the chat template of {tokenizer_name(tokenizer)} does not render "
                             f"conversations turn by turn (the text up to message {i} is not the start of the "
                             "whole conversation), so the answers cannot be found; use format = "
                             '"prompt-completion", or data.completion_only_loss = false to train every token')
        spans.append((start, len(upto)))
    return spans


def _ids(tokenizer: Any, text: str, special: bool) -> list[int]:
    if _is_char(tokenizer):
        return list(tokenizer(text)["input_ids"])
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _mark(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """``text`` tokenized once (no special tokens added: the template wrote them), and which
    tokens have a character inside one of ``spans``."""
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
        trained = [any((s < b and e > a) or (s == e and a <= s < b) for a, b in spans) for s, e in offsets]
        return ids, trained
    # A slow tokenizer has no offsets: the answers and the text between them are tokenized apart.
    ids, trained, at = [], [], 0
    for a, b in spans + [(len(text), len(text))]:
        for piece, inside in ((text[at:a], False), (text[a:b], True)):
            if piece:
                piece_ids = _ids(tokenizer, piece, False)
                ids += piece_ids
                trained += [inside] * len(piece_ids)
        at = b
    return ids, trained


def encode_messages(tokenizer: Any, messages: Any, where: str = "data.train row 0",
                    need_answers: bool = True) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation rendered with the chat template, and which are the
    assistant's answers (all False when ``need_answers`` is False: nothing is looked up)."""
    checked = _checked_messages(messages, where)
    full = _render(tokenizer, checked, where)
    spans = _answer_spans(tokenizer, checked, full, where) if need_answers else []
    return _mark(tokenizer, full, spans)


def encode_prompt_completion(tokenizer: Any, prompt: Any, completion: Any,
                             where: str = "data.train row 0") -> tuple[list[int], list[bool]]:
    """Prompt tokens (with the tokenizer's special tokens), completion tokens (without), then
    the eos token (unless the completion already ends with it); True marks the completion."""
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise ValueError(f"{where}: {name} must be text, got {_short(value)}")  # noqa: TRY004 - a data problem
    prompt_ids = _ids(tokenizer, prompt, True)
    completion_ids = _ids(tokenizer, completion, False)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and (not completion_ids or completion_ids[-1] != eos):
        completion_ids.append(eos)
    return prompt_ids + completion_ids, [False] * len(prompt_ids) + [True] * len(completion_ids)


def labeled_example(ids: Sequence[int], trained: Sequence[bool], *, completion_only_loss: bool = True,
                    max_length: int | None = None, where: str = "data.train row 0",
                    why_nothing: str = "nothing in it is an answer") -> dict[str, list[int]]:
    """``input_ids``, ``attention_mask`` and ``labels`` of one row, cut to ``max_length`` together.

    Labels are -100 on untrained tokens (only with ``completion_only_loss``). A row left with
    no trained token would add nothing but cost a forward pass, and says a data problem: an
    error naming the row.
    """
    ids = list(ids)
    if completion_only_loss:
        if not any(trained):
            raise ValueError(f"{where}: no token to train: {why_nothing}")
        labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids, trained)]
    else:
        labels = list(ids)
    if max_length is not None and len(ids) > max_length:
        ids, labels = ids[:max_length], labels[:max_length]
        if completion_only_loss and all(label == IGNORE_INDEX for label in labels):
            prompt = list(trained).index(True)
            raise ValueError(f"{where}: no token left to train (the prompt takes {prompt} of max_length = "
                             f"{max_length} tokens); raise data.max_length or shorten the prompt")
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def pack_examples(examples: Sequence[dict], block: int) -> tuple[list[dict], int]:
    """Examples concatenated and cut into ``block``-token rows; labels keep each row's masks.

    The short remainder is kept as a last, shorter row (the collator pads it); rows with no
    trained token are dropped. Returns (the rows, how many were dropped).
    """
    ids = [t for ex in examples for t in ex["input_ids"]]
    labels = [t for ex in examples for t in ex["labels"]]
    rows, dropped = [], 0
    for at in range(0, len(ids), block):
        part = labels[at:at + block]
        if all(label == IGNORE_INDEX for label in part):
            dropped += 1
            continue
        rows.append({"input_ids": ids[at:at + block], "attention_mask": [1] * len(part), "labels": part})
    return rows, dropped


# -- a batch of rows (Dataset.map) -------------------------------------------------------------


def _row_example(batch: dict[str, list], k: int, index: int, *, tokenizer: Any, format: str,
                 completion_only_loss: bool, max_length: int | None, where: str) -> dict[str, list[int]]:
    row_where = f"{where} row {index}"
    if format == "messages":
        messages = batch["messages"][k]
        if messages is None:
            present = [name for name, values in batch.items() if values[k] is not None]
            raise ValueError(f"{row_where}: no messages (the row has: {', '.join(present) or 'nothing'})")
        ids, trained = encode_messages(tokenizer, messages, row_where, need_answers=completion_only_loss)
        roles = ", ".join(str(m.get("role")) for m in messages)
        why = (f"the conversation has no assistant answer (roles: {roles}); add one, or set "
               "data.completion_only_loss = false to train every token")
    else:
        ids, trained = encode_prompt_completion(tokenizer, batch["prompt"][k], batch["completion"][k], row_where)
        why = "the completion is empty; add one, or set data.completion_only_loss = false to train every token"
    return labeled_example(ids, trained, completion_only_loss=completion_only_loss, max_length=max_length,
                           where=row_where, why_nothing=why)


def chat_rows_batch(batch: dict[str, list], indices: list[int], *, tokenizer: Any, format: str,
                    completion_only_loss: bool = True, max_length: int | None = None, where: str = "data.train",
                    length_column: str | None = None, block: int | None = None,
                    dropped: list[int] | None = None) -> dict[str, list]:
    """A ``Dataset.map(batched=True, with_indices=True)`` function: rows to labeled examples,
    truncated to ``max_length``, or (``block``) packed into ``block``-token rows whose count
    of dropped (untrained) rows is added to ``dropped[0]``."""
    examples = [_row_example(batch, k, index, tokenizer=tokenizer, format=format,
                             completion_only_loss=completion_only_loss,
                             max_length=None if block else max_length, where=where)
                for k, index in enumerate(indices)]
    if block:
        examples, count = pack_examples(examples, block)
        if dropped is not None:
            dropped[0] += count
    out: dict[str, list] = {key: [ex[key] for ex in examples] for key in ("input_ids", "attention_mask", "labels")}
    if length_column:
        out[length_column] = [len(ex["input_ids"]) for ex in examples]
    return out


def prepare_chat_dataset(dataset: Any, tokenizer: Any, *, format: str,
                         completion_only_loss: bool = True, max_length: int | None = None, packing: bool = False,
                         length_column: str | None = None, cache_file: str | None = None,
                         fingerprint: str | None = None, desc: str = "Preparing", where: str = "data.train") -> Any:
    """``dataset``'s rows as ``input_ids``/``attention_mask``/``labels`` through ``Dataset.map``.

    Written to ``cache_file`` (reused when it exists; ``fingerprint`` names the result), else
    kept in memory, so nothing is written. Every source column is replaced. A problem in a
    row stops the map with a one-line ValueError naming it.
    """
    if format not in FORMATS:
        raise ValueError(f"data.format: unknown format {format!r}; choices: {', '.join(FORMATS)}")
    if packing and not max_length:
        raise ValueError("data.packing: needs data.max_length (the block size in tokens)")
    check_chat_columns(dataset, format, where)
    check_chat_tokenizer(tokenizer, format)
    dropped = [0]
    fn_kwargs = {"tokenizer": tokenizer, "format": format, "completion_only_loss": completion_only_loss,
                 "max_length": max_length, "where": where, "length_column": None if packing else length_column,
                 "block": max_length if packing else None, "dropped": dropped}
    remove = list(getattr(dataset, "column_names", None) or []) or None
    if not hasattr(dataset, "cache_files"):  # an IterableDataset: mapped lazily while iterating
        return dataset.map(chat_rows_batch, batched=True, with_indices=True, fn_kwargs=fn_kwargs, remove_columns=remove)
    # The fingerprint is given: datasets would otherwise hash the tokenizer (slow, and
    # unhashable ones get a random name with a warning).
    kwargs: dict[str, Any] = {"new_fingerprint": fingerprint or uuid.uuid4().hex[:16]}
    if cache_file is not None:
        kwargs.update(cache_file_name=str(cache_file), load_from_cache_file=True)
    else:
        kwargs.update(keep_in_memory=True)
    prepared = dataset.map(chat_rows_batch, batched=True, with_indices=True, fn_kwargs=fn_kwargs,
                           remove_columns=remove, desc=desc, **kwargs)
    if dropped[0]:
        log.warning("%s: packing dropped %d block%s of data.max_length = %d tokens with no token to train (%d "
                    "kept)", where, dropped[0], "" if dropped[0] == 1 else "s", max_length, len(prepared))
    if packing and not len(prepared):
        raise ValueError(f"{where}: packing left no block with a token to train")
    return prepared
