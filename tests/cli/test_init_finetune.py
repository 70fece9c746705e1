"""``workbench init --finetune [--example]`` in process: the fine-tuning starter is a commented
config that loads as written next to a model and data, and every refusal (the example's files
already there, ``--example`` without ``--finetune``, an existing config) is one line, exit 2,
with nothing written. tests/cli/test_finetune_e2e.py runs the starter through ``workbench run``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from workbench.cli import main
from workbench.config.loader import load_config, starter_config_text

pytest.importorskip("transformers")
pytest.importorskip("peft")

# The options a user has to understand to adapt the starter: each carries its comment.
COMMENTED = ("pretrained", "r", "lora_alpha", "lora_dropout", "target_modules", "format", "completion_only_loss",
             "max_length", "output_dir", "learning_rate", "every", "nonfinite", "spike")
EXAMPLE_FILES = ("models/tiny-llama", "data/chat.jsonl", "data/chat_eval.jsonl", "data/completions.jsonl")


def _tree(root: Path) -> dict[str, str | None]:
    """Every path under ``root`` with a file's text (None for a folder): what a refusal must
    leave as it was."""
    return {str(p.relative_to(root)): (p.read_text() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _refused(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("workbench: "), err
    return err


def test_the_finetune_starter_is_commented_and_loads_next_to_a_model_and_data(finetune_workspace, tmp_path,
                                                                              capsys):
    path = tmp_path / "ft.toml"
    assert main(["init", "--finetune", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"workbench run {path}" in out and f"workbench data {path} --show 3" in out
    assert [p.name for p in tmp_path.iterdir()] == ["ft.toml"]  # without --example: the config alone
    text = path.read_text()
    assert text == starter_config_text(finetune=True, file="ft.toml")
    assert text.splitlines()[0].startswith("# workbench fine-tuning config (ft.toml): `workbench run ft.toml`")
    for key in COMMENTED:
        (line,) = [ln for ln in text.splitlines() if ln.startswith(f"{key} = ")]
        assert "#" in line.split("=", 1)[1], f"{key} has no comment"
    # It loads as is with the model and data where it says (the example's layout, linked in).
    for name in ("models", "data"):
        (tmp_path / name).symlink_to(finetune_workspace.root / name, target_is_directory=True)
    config = load_config(path)
    assert Path(config.model.pretrained).resolve() == finetune_workspace.model.resolve()
    assert config.model.peft["r"] == 8 and config.model.peft["target_modules"] == ["q_proj", "v_proj"]
    assert (config.data.format, config.data.completion_only_loss, config.data.max_length) == ("messages", True, 256)
    assert config.run_name == "ft" and config.training.output_dir == str(tmp_path / "runs" / "ft")
    assert list(config.samples.prompts) == ["What is 2 plus 3?", "What is 4 plus 5?"]
    assert (config.guard.nonfinite, config.guard.spike) == ("skip", "rollback")
    assert not (tmp_path / "runs").exists()  # loading writes nothing


@pytest.mark.parametrize("existing", EXAMPLE_FILES)
def test_example_over_existing_files_refuses_in_one_line_and_writes_nothing(tmp_path, capsys, existing):
    mine = tmp_path / existing
    if mine.suffix:
        mine.parent.mkdir(parents=True)
        mine.write_text("mine\n")
    else:
        mine.mkdir(parents=True)
        (mine / "config.json").write_text("{}\n")
    before = _tree(tmp_path)
    err = _refused(capsys, ["init", "--finetune", "--example", str(tmp_path / "ft.toml")])
    assert f"{mine} already exists" in err and "--example" in err
    assert _tree(tmp_path) == before  # no config, no model, no data, the user's file untouched


def test_other_init_refusals_are_one_line_and_write_nothing(tmp_path, capsys):
    err = _refused(capsys, ["init", "--example", str(tmp_path / "ft.toml")])
    assert "use it with --finetune" in err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "ft.toml").write_text("# mine\n")
    assert "already exists" in _refused(capsys, ["init", "--finetune", str(tmp_path / "ft.toml")])
    assert (tmp_path / "ft.toml").read_text() == "# mine\n"
