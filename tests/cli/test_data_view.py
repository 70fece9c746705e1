"""``workbench data CONFIG --show N`` in process: the train rows decoded with the trained tokens
marked, a summary, one line and exit 2 for bad input, and nothing written into output_dir.
tests/cli/test_chat_data_e2e.py runs the same through the ``workbench`` command.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.cli.data_view import marked_text, row_groups
from workbench.data.datasets_io import load_tokenizer

from support.finetune import build_workspace, chat_rows, completion_rows, write_jsonl


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("data-view"), rows=12)


def write_config(folder: Path, ws, data: str, model: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cfg.toml"
    path.write_text(f'[model]\n{model or f"pretrained = {str(ws.model)!r}"}\n[data]\n{data}\n'
                    '[training]\noutput_dir = "out"\n')
    return path


def view(capsys, *args) -> tuple[int, str, str]:
    code = main(["data", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_chat_rows_are_shown_with_the_answers_marked(tmp_path, ws, capsys):
    config = write_config(tmp_path, ws, f'train = {{ path = "{ws.chat}" }}\nformat = "messages"')
    code, out, err = view(capsys, config, "--show", 2)
    assert code == 0, err
    tok = load_tokenizer(str(ws.model))
    rows = chat_rows(12)
    headers = re.findall(r"^-- row (\d+): (\d+) tokens, (\d+) trained$", out, re.MULTILINE)
    assert [h[0] for h in headers] == ["0", "1"]
    for (_, tokens, trained), row in zip(headers, rows):
        text = tok.apply_chat_template(row["messages"], tokenize=False)
        answer = row["messages"][-1]["content"] + "<|end|>"
        assert int(tokens) == len(tok(text, add_special_tokens=False)["input_ids"])
        assert int(trained) == len(tok(answer, add_special_tokens=False)["input_ids"])
        # The row as rendered, with exactly its answer marked.
        assert text.replace(answer, f"[[{answer}]]") in out.splitlines()
    assert out.count("[[") == 3  # the two answers and the legend
    summary = out.strip().splitlines()[-1]
    assert re.fullmatch(r"data\.train: 12 rows, [\d.]+ tokens a row on average, [\d.]+ trained \([\d.]+% of the "
                        r"tokens\)", summary), summary
    assert not (tmp_path / "out").exists()  # prepared in memory: nothing written


def test_prompt_completion_packing_and_text_column_data_are_shown(tmp_path, ws, capsys):
    data = f'train = {{ path = "{ws.completions}" }}\nformat = "prompt-completion"\nmax_length = 16\npacking = true'
    code, out, err = view(capsys, write_config(tmp_path, ws, data), "--show", 1)
    assert code == 0, err
    first = completion_rows(12)[0]
    assert out.splitlines()[3].startswith(f"{first['prompt']}[[{first['completion']}<|end|>]]")
    assert re.search(r"^-- row 0: 16 tokens, \d+ trained$", out, re.MULTILINE)
    # Plain text: everything is trained (labels come from input_ids in the collator).
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": "hello world"}, {"text": "abc"}])
    data = f'train = {{ path = "{texts}" }}\ntext_column = "text"\ntokenizer = "char"'
    code, out, err = view(capsys, write_config(tmp_path / "text", ws, data, 'builtin = "tiny-gpt"'), "--show", 5)
    assert code == 0, err
    assert "-- row 0: 11 tokens, 11 trained\n[[hello world]]" in out and "-- row 1: 3 tokens, 3 trained\n[[abc]]" in out
    assert out.strip().endswith("data.train: 2 rows, 7.0 tokens a row on average, 7.0 trained (100.0% of the tokens)")
    assert not (tmp_path / "out").exists() and not (tmp_path / "text" / "out").exists()


@pytest.mark.parametrize("data, expected", [
    ('format = "messages"\nmax_length = 8', "data.train row 0: no token left to train (the prompt takes "),
    ('format = "prompt-completion"', 'data.train: format = "prompt-completion" needs text columns'),
    ('format = "messages"\ncompletion_only_loss = "no"', "data.completion_only_loss: expected true or false"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, ws, capsys, data, expected):
    config = write_config(tmp_path, ws, f'train = {{ path = "{ws.chat}" }}\n{data}')
    code, out, err = view(capsys, config)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "out").exists()


def test_show_counts_rows_and_untokenized_data_has_nothing_to_show(tmp_path, ws, capsys):
    config = write_config(tmp_path, ws, f'train = {{ path = "{ws.chat}" }}\nformat = "messages"')
    code, _, err = view(capsys, config, "--show", -1)
    assert code == 2 and err == "workbench: --show: expected a number of rows (0 or more), got -1\n"
    code, out, _ = view(capsys, config, "--show", 0)
    assert code == 0 and "-- row" not in out and "data.train: 12 rows" in out
    config = write_config(tmp_path / "raw", ws, f'train = {{ path = "{ws.chat}" }}')
    code, _, err = view(capsys, config)
    assert code == 2 and err.strip() == (f"workbench: {config}: data.train has no input_ids to show (columns: "
                                         'messages); set data.text_column or data.format = "messages" / '
                                         '"prompt-completion"')


def test_rows_group_by_trained_and_markers_follow_the_terminal():
    ids, trained = [1, 2, 3, 4, 5], [False, True, True, False, True]
    assert list(row_groups(ids, trained)) == [(False, [1]), (True, [2, 3]), (False, [4]), (True, [5])]
    assert list(row_groups([], [])) == []
    assert marked_text("x", tty=False) == "[[x]]"
    assert marked_text("x", tty=True) == "\x1b[7;32mx\x1b[0m"
