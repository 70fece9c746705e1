"""Chat and instruction rows (workbench/data/chat.py): only the answers are trained, and
truncation, packing and the cache keep the masks right; each bad input is one line.

The expected tokens are computed apart from the code under test: each answer (with the
template's end-of-turn token) and each completion (with eos) is tokenized on its own and
must be exactly the trained tokens. One tiny workspace (a BPE tokenizer with a chat
template, tests/support/finetune.py) is built per module.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from datasets import Dataset

from workbench.config.loader import load_config
from workbench.data.chat import (
    IGNORE_INDEX,
    encode_messages,
    encode_prompt_completion,
    labeled_example,
    pack_examples,
    prepare_chat_dataset,
)
from workbench.data.datasets_io import load_run_data, load_tokenizer

from support.finetune import build_chat_tokenizer, build_workspace, chat_rows, completion_rows, write_jsonl

END = "<|end|>"  # the template's end of a turn, and the eos token


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def tok(ws):
    return load_tokenizer(str(ws.model))


def answer_ids(tok, messages) -> list[int]:
    """The tokens of every assistant answer, each with its end-of-turn token, tokenized apart."""
    return [t for m in messages if m["role"] == "assistant" for t in tok(m["content"] + END,
                                                                          add_special_tokens=False)["input_ids"]]


def trained_ids(example: dict) -> list[int]:
    return [t for t, label in zip(example["input_ids"], example["labels"]) if label != IGNORE_INDEX]


def prepare(rows, tok, **kwargs):
    return prepare_chat_dataset(Dataset.from_list(rows), tok, **kwargs)


# -- only the answers are trained ----------------------------------------------------------------


def test_messages_train_exactly_the_assistant_answers_with_their_end_token(tok):
    rows = chat_rows(24)
    prepared = prepare(rows, tok, format="messages")
    assert prepared.column_names == ["input_ids", "attention_mask", "labels"]
    for row, example in zip(rows, prepared):
        expected = answer_ids(tok, row["messages"])
        assert trained_ids(example) == expected and len(expected) >= 2
        # The rest is the prompt as the template renders it; labels sit on their own tokens.
        full = tok.apply_chat_template(row["messages"], tokenize=False)
        assert example["input_ids"] == tok(full, add_special_tokens=False)["input_ids"]
        assert [label for label in example["labels"] if label != IGNORE_INDEX] == expected
        assert example["labels"][-len(expected):] == expected  # the answer ends the row
        assert example["attention_mask"] == [1] * len(example["input_ids"])


def test_every_answer_of_a_multi_turn_conversation_is_trained_and_no_user_turn(tok):
    messages = [{"role": "system", "content": "Answer in words."},
                {"role": "user", "content": "What is 1 plus 2?"}, {"role": "assistant", "content": "three."},
                {"role": "user", "content": "What is 4 plus 4?"}, {"role": "assistant", "content": "eight."},
                {"role": "user", "content": "What is 0 plus 0?"}]  # a last question with no answer
    ids, trained = encode_messages(tok, messages)
    assert [t for t, on in zip(ids, trained) if on] == answer_ids(tok, messages)
    runs = "".join("1" if on else "0" for on in trained).strip("0").split("0")
    assert len([r for r in runs if r]) == 2  # two separate answers
    assert tok.decode([t for t, on in zip(ids, trained) if not on]).endswith("<|user|>What is 0 plus 0?" + END)


def test_a_conversation_that_opens_with_the_assistant_trains_its_content(tok):
    messages = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 1 plus 1?"},
                {"role": "assistant", "content": "two."}]
    ids, trained = encode_messages(tok, messages)
    assert [t for t, on in zip(ids, trained) if on] == answer_ids(tok, messages)


def test_a_slow_tokenizer_marks_the_same_tokens(tok):
    class Slow:  # no offsets: the answers and the text between them are tokenized apart
        is_fast = False

        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, *args, **kwargs):
            assert "return_offsets_mapping" not in kwargs
            return tok(*args, **kwargs)

    for row in chat_rows(6):
        assert encode_messages(Slow(), row["messages"]) == encode_messages(tok, row["messages"])


def test_prompt_completion_trains_the_completion_and_eos(tok):
    rows = completion_rows(16)
    prepared = prepare(rows, tok, format="prompt-completion")
    for row, example in zip(rows, prepared):
        prompt = tok(row["prompt"])["input_ids"]
        completion = tok(row["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert example["input_ids"] == prompt + completion
        assert example["labels"] == [IGNORE_INDEX] * len(prompt) + completion
    # A completion that already ends with eos gets no second one.
    ids, trained = encode_prompt_completion(tok, "1 plus 1 is", " two." + END)
    assert ids.count(tok.eos_token_id) == 1 and trained[-1]


@pytest.mark.parametrize("fmt, rows", [("messages", chat_rows(8)), ("prompt-completion", completion_rows(8))])
def test_without_completion_only_loss_every_token_is_trained(tok, fmt, rows):
    masked = prepare(rows, tok, format=fmt)
    everything = prepare(rows, tok, format=fmt, completion_only_loss=False)
    for a, b in zip(masked, everything):
        assert b["input_ids"] == a["input_ids"] and b["labels"] == b["input_ids"]
        assert sum(label != IGNORE_INDEX for label in a["labels"]) < len(a["labels"])


def test_the_length_column_of_the_length_aware_samplers_is_each_rows_length(tok):
    prepared = prepare(chat_rows(6), tok, format="messages", max_length=18, length_column="length")
    assert prepared["length"] == [len(ids) for ids in prepared["input_ids"]]
    assert max(prepared["length"]) == 18 and min(prepared["length"]) < 18


# -- truncation and packing keep the masks ---------------------------------------------------------


def test_truncation_cuts_ids_and_labels_together(tok):
    rows = chat_rows(12)
    full = prepare(rows, tok, format="messages")
    for limit in (17, 18, 40):
        cut = prepare(rows, tok, format="messages", max_length=limit)
        for a, b in zip(full, cut):
            assert b["input_ids"] == a["input_ids"][:limit] and b["labels"] == a["labels"][:limit]
            assert b["attention_mask"] == [1] * min(limit, len(a["input_ids"]))


def test_packing_cuts_the_rows_labels_into_blocks_and_drops_untrained_blocks(tok, caplog):
    rows = chat_rows(20)
    # A long system line makes whole blocks of prompt: they are dropped, and said.
    rows[5]["messages"][0:0] = [{"role": "system", "content": " ".join(["Answer in words."] * 12)}]
    unpacked = prepare(rows, tok, format="messages")
    stream_ids = [t for ex in unpacked for t in ex["input_ids"]]
    stream_labels = [t for ex in unpacked for t in ex["labels"]]
    block = 16
    chunks = [(stream_ids[i:i + block], stream_labels[i:i + block]) for i in range(0, len(stream_ids), block)]
    expected = [c for c in chunks if any(label != IGNORE_INDEX for label in c[1])]
    assert len(expected) < len(chunks)  # the case really drops blocks
    with caplog.at_level(logging.WARNING, logger="workbench"):
        packed = prepare(rows, tok, format="messages", max_length=block, packing=True)
    assert [(ex["input_ids"], ex["labels"]) for ex in packed] == expected
    assert all(len(ex["input_ids"]) == block for ex in list(packed)[:-1])
    dropped = len(chunks) - len(expected)
    assert f"data.train: packing dropped {dropped} block" in caplog.text
    assert f"({len(expected)} kept)" in caplog.text


def test_pack_examples_keeps_the_remainder_and_counts_dropped_blocks():
    examples = [labeled_example([1, 2, 3, 4, 5], [False, False, False, True, True]),
                labeled_example([6, 7, 8], [False, False, True])]
    rows, dropped = pack_examples(examples, 2)
    assert dropped == 1  # [1, 2]: nothing trained
    assert [r["input_ids"] for r in rows] == [[3, 4], [5, 6], [7, 8]]
    assert [r["labels"] for r in rows] == [[-100, 4], [5, -100], [-100, 8]]


# -- bad input: one line naming the row -----------------------------------------------------------


def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_rows_without_messages_name_the_row_and_its_columns(tok):
    with pytest.raises(ValueError) as info:
        prepare([{"text": "hello"}], tok, format="messages")
    assert one_line(info) == ('data.train: format = "messages" needs a \'messages\' column (a list of {role, '
                              "content} messages); the data has no 'messages' column (columns: text); rename one "
                              'with data.columns = { old = "messages" }')
    rows = [dict(r, text=None) for r in chat_rows(3)] + [{"messages": None, "text": "hello"}]
    with pytest.raises(ValueError) as info:
        prepare(rows, tok, format="messages")
    assert one_line(info) == "data.train row 3: no messages (the row has: text)"


@pytest.mark.parametrize("messages, expected", [
    ("hello", "data.train row 0: messages must be a non-empty list of {role, content} messages, got 'hello'"),
    ([], "data.train row 0: messages must be a non-empty list of {role, content} messages, got []"),
    ([{"role": "user"}], ("data.train row 0: message 0 is not a {role, content} dict with text content "
                         "(got {'role': 'user'})")),
    ([{"role": "user", "content": "hi"}, "answer"], ("data.train row 0: message 1 is not a {role, content} dict "
                                                    "with text content (got 'answer')")),
])
def test_malformed_messages_are_one_line(tok, messages, expected):
    with pytest.raises(ValueError) as info:
        encode_messages(tok, messages)
    assert one_line(info) == expected


def test_a_tokenizer_without_a_chat_template_says_how_to_fix_it(tmp_path):
    folder = tmp_path / "plain-tok"
    build_chat_tokenizer(folder, chat_template=None)
    with pytest.raises(ValueError) as info:
        prepare(chat_rows(2), load_tokenizer(str(folder)), format="messages")
    assert one_line(info) == (f'data.format = "messages": the tokenizer in {folder} has no chat template; set '
                              "tokenizer.chat_template and save it (chat_template.jinja in the folder), point "
                              "data.tokenizer at a tokenizer folder that has one, or use format = "
                              '"prompt-completion"')
    with pytest.raises(ValueError, match='^data.format = "messages": the built-in "char" tokenizer has no chat'):
        prepare(chat_rows(2), load_tokenizer("char"), format="messages")


def test_a_row_with_nothing_to_train_is_named(tok):
    rows = chat_rows(4)
    rows[2] = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]}
    with pytest.raises(ValueError) as info:
        prepare(rows, tok, format="messages")
    assert one_line(info) == ("data.train row 2: no token to train: the conversation has no assistant answer "
                              "(roles: system, user); add one, or set data.completion_only_loss = false to train "
                              "every token")
    prepare(rows, tok, format="messages", completion_only_loss=False)  # then it is fine
    with pytest.raises(ValueError, match="^data.train row 1: no token to train: the completion is empty"):
        prepare([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""}],
                type("NoEos", (), {"__getattr__": lambda s, n: getattr(tok, n), "eos_token_id": None,
                                   "__call__": lambda s, *a, **k: tok(*a, **k)})(), format="prompt-completion")


def test_truncation_that_leaves_no_answer_names_the_row_and_the_prompt_length(tok):
    rows = chat_rows(6)
    prompts = [len(tok(tok.apply_chat_template(r["messages"][:-1], tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]) for r in rows]
    limit = max(prompts)
    first = prompts.index(limit)  # the first row whose prompt fills max_length
    assert min(prompts) < limit
    with pytest.raises(ValueError) as info:
        prepare(rows, tok, format="messages", max_length=limit)
    assert one_line(info) == (f"data.train row {first}: no token left to train (the prompt takes {limit} of "
                              f"max_length = {limit} tokens); raise data.max_length or shorten the prompt")
    prepare(rows, tok, format="messages", max_length=max(prompts) + 1)  # one answer token each: fine


def test_a_template_that_does_not_render_turn_by_turn_is_refused(tok, tmp_path):
    folder = tmp_path / "odd-tok"
    # The last message is rendered differently, so the prompt is no prefix of the whole.
    build_chat_tokenizer(folder, chat_template="{% for m in messages %}{% if loop.last %}[last]{% endif %}"
                                               "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}")
    with pytest.raises(ValueError) as info:
        prepare(chat_rows(2), load_tokenizer(str(folder)), format="messages")
    assert one_line(info).startswith(f"data.train row 0: the chat template of the tokenizer in {folder} does not "
                                     "render conversations turn by turn (the text up to message 2 is not the start "
                                     "of the whole conversation)")
    failing = tmp_path / "raising-tok"
    build_chat_tokenizer(failing, chat_template="{{ raise_exception('roles must alternate user/assistant') }}")
    with pytest.raises(ValueError) as info:
        prepare(chat_rows(2), load_tokenizer(str(failing)), format="messages")
    assert one_line(info) == (f"data.train row 0: the chat template of the tokenizer in {failing} failed on this "
                              "conversation: roles must alternate user/assistant")


def test_prompt_completion_needs_both_text_columns(tok):
    with pytest.raises(ValueError, match=r"^data.train: format = \"prompt-completion\" needs text columns 'prompt' "
                                         r"and 'completion'; the data has no 'completion' column \(columns: prompt\)"):
        prepare([{"prompt": "a"}], tok, format="prompt-completion")
    with pytest.raises(ValueError, match=r"^data.train row 1: completion must be text, got None$"):
        prepare([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": None}], tok,
                format="prompt-completion")


# -- through [data]: the cache, and nothing left behind by broken data ---------------------------------


def write_config(folder: Path, ws, data: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cfg.toml"
    path.write_text(f'[model]\npretrained = "{ws.model}"\n[data]\n{data}\n[training]\noutput_dir = "out"\n')
    return path


def test_load_run_data_caches_by_every_option_and_reuses_the_cache(tmp_path, ws):
    data = f'train = {{ path = "{ws.chat}" }}\nformat = "messages"\nmax_length = 24'
    run = load_config(write_config(tmp_path, ws, data))
    first = load_run_data(run, progress=False)
    cache = tmp_path / "out" / "data_cache"
    files = sorted(os.listdir(cache))
    assert len(files) == 1 and files[0].startswith("chat-")
    assert load_run_data(run, progress=False).train["labels"] == first.train["labels"]
    assert sorted(os.listdir(cache)) == files  # reused
    for extra in ("completion_only_loss = false", "packing = true"):
        load_run_data(load_config(write_config(tmp_path, ws, data + "\n" + extra)), progress=False)
    assert len(os.listdir(cache)) == 3  # each option has its own cache
    memory = load_run_data(load_config(write_config(tmp_path / "dry", ws, data)), progress=False, cache=False)
    assert memory.train["labels"] == first.train["labels"] and not (tmp_path / "dry" / "out").exists()


def test_a_bad_eval_row_leaves_no_output_dir_behind(tmp_path, ws):
    bad = write_jsonl(tmp_path / "bad.jsonl", chat_rows(3) + [{"messages": [{"role": "user", "content": "Hi?"}]}])
    data = f'train = {{ path = "{ws.chat}" }}\neval = {{ path = "{bad}" }}\nformat = "messages"'
    run = load_config(write_config(tmp_path, ws, data))
    with pytest.raises(ValueError, match="^data.eval row 3: no token to train"):
        load_run_data(run, progress=False)
    assert not (tmp_path / "out").exists()  # the train set's cache went with it
    (tmp_path / "out" / "data_cache").mkdir(parents=True)
    (tmp_path / "out" / "data_cache" / "kept.arrow").write_text("x")
    with pytest.raises(ValueError, match="^data.eval row 3"):
        load_run_data(run, progress=False)
    assert os.listdir(tmp_path / "out" / "data_cache") == ["kept.arrow"]  # only what this call wrote goes
