"""Chat data through the ``workbench`` command, as a user types it: ``workbench data CONFIG
--show 2`` prints the rows with the answers marked and writes nothing, and ``workbench run``
on each kind of bad chat input exits 2 with one line on stderr, before anything is written
into output_dir (a fresh one is not created; an existing one is left as it was).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.finetune import build_chat_tokenizer, build_workspace, chat_rows, write_jsonl
from support.processes import workbench


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("chat-cli"), rows=12)


def write_config(folder: Path, ws, data: str, tokenizer: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cfg.toml"
    path.write_text(f"""\
[model]
pretrained = "{ws.model}"
[data]
{data}
{tokenizer}
[training]
output_dir = "out"
max_steps = 2
per_device_train_batch_size = 4
report_to = "none"
""")
    return path


def one_line(result, code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_workbench_data_shows_marked_rows_and_writes_nothing(tmp_path, ws):
    config = write_config(tmp_path, ws, f'train = {{ path = "{ws.chat}" }}\nformat = "messages"')
    result = workbench("data", config.name, "--show", 2, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for row in chat_rows(2):
        answer = row["messages"][-1]["content"]
        assert f"<|assistant|>[[{answer}<|end|>]]" in result.stdout
    assert result.stdout.count("-- row ") == 2 and "data.train: 12 rows" in result.stdout
    assert not (tmp_path / "out").exists()
    bad = write_config(tmp_path / "bad", ws, f'train = {{ path = "{ws.chat}" }}\nformat = "mesages"')
    line = one_line(workbench("data", bad.name, cwd=bad.parent), 2)
    assert line == ("workbench: cfg.toml:5: data.format: unknown format 'mesages' (did you mean messages?); "
                    "choices: messages, prompt-completion")


def bad_cases(root: Path, ws) -> dict[str, tuple[str, str, str]]:
    """name: ([data] lines, tokenizer line, the start of the expected line after 'workbench: cfg.toml: ')."""
    rows = chat_rows(6)
    no_messages = write_jsonl(root / "no-messages.jsonl", [dict(r, text=None) for r in rows[:4]]
                              + [{"messages": None, "text": "hello"}])
    malformed = write_jsonl(root / "malformed.jsonl", rows[:2] + [{"messages": [{"role": "user", "text": "Hi"}]}])
    no_answer = write_jsonl(root / "no-answer.jsonl", rows[:3] + [{"messages": [{"role": "user", "content": "Hi"}]}])
    plain = root / "plain-tokenizer"
    build_chat_tokenizer(plain, chat_template=None)
    chat = f'train = {{ path = "{ws.chat}" }}\nformat = "messages"'
    return {
        "rows lacking messages": (f'train = {{ path = "{no_messages}" }}\nformat = "messages"', "",
                                  "data.train row 4: no messages (the row has: text)"),
        "malformed messages": (f'train = {{ path = "{malformed}" }}\nformat = "messages"', "",
                               "data.train row 2: message 0 is not a {role, content} dict with text content"),
        "no chat template": (chat, f'tokenizer = "{plain}"',
                             f'data.format = "messages": the tokenizer in {plain} has no chat template'),
        "truncated away": (chat + "\nmax_length = 8", "", ("data.train row 0: no token left to train (the prompt "
                           "takes 16 of max_length = 8 tokens); raise data.max_length or shorten the prompt")),
        "no assistant turn": (f'train = {{ path = "{no_answer}" }}\nformat = "messages"', "",
                              ("data.train row 3: no token to train: the conversation has no assistant answer "
                              "(roles: user)")),
        "a bad eval row": (chat + f'\neval = {{ path = "{no_answer}" }}', "", "data.eval row 3: no token to train"),
    }


CASES = ["rows lacking messages", "malformed messages", "no chat template", "truncated away", "no assistant turn",
         "a bad eval row"]


@pytest.mark.parametrize("case", CASES)
def test_bad_chat_data_is_one_line_exit_2_and_nothing_written(tmp_path, ws, case):
    data, tokenizer, expected = bad_cases(tmp_path, ws)[case]
    config = write_config(tmp_path, ws, data, tokenizer)
    line = one_line(workbench("run", config.name, "--headless", cwd=tmp_path), 2)
    assert line.startswith(f"workbench: cfg.toml: {expected}"), line
    assert not (tmp_path / "out").exists()  # not even the train set's cache


def test_an_existing_output_dir_is_left_as_it_was(tmp_path, ws):
    data, _, expected = bad_cases(tmp_path, ws)["a bad eval row"]
    config = write_config(tmp_path, ws, data)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.json").write_text(json.dumps({"mine": True}))
    line = one_line(workbench("run", config.name, "--headless", cwd=tmp_path), 2)
    assert line.startswith(f"workbench: cfg.toml: {expected}"), line
    assert sorted(p.name for p in out.iterdir()) == ["notes.json"]  # no data_cache, no lock, no config.toml
