"""``[model.peft]``: a LoRA adapter from the config file, and each mistake in it one line that
names the file, the line and the key -- found before anything is built or written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from workbench.cli import main  # noqa: E402
from workbench.config import loader  # noqa: E402
from workbench.config.build import build_model  # noqa: E402
from workbench.config.loader import ConfigError, load_config  # noqa: E402
from workbench.models.adapters import is_peft_model, parameter_split, unmatched_targets  # noqa: E402


def _config(tmp_path: Path, workspace, peft: str, model: str | None = None) -> Path:
    model = model if model is not None else f'pretrained = "{workspace.model}"'
    text = (f'[model]\n{model}\n[model.peft]\n{peft}\n'
            f'[data]\nbuiltin = "python-source"\n[training]\noutput_dir = "{tmp_path / "out"}"\nmax_steps = 2\n')
    path = tmp_path / "lora.toml"
    path.write_text(text)
    return path


def test_a_peft_table_builds_a_lora_model_of_the_pretrained_folder(finetune_workspace, tmp_path):
    path = _config(tmp_path, finetune_workspace, 'r = 4\nlora_alpha = 8\ntarget_modules = ["q_proj", "v_proj"]')
    run = load_config(path)
    assert run.model.peft == {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    model = build_model(run)
    assert is_peft_model(model) and model.peft_config["default"].task_type == "CAUSAL_LM"
    trained, frozen = parameter_split(model)
    assert 0 < trained < frozen
    assert "[model.peft]" in loader.dump_config(run)  # output_dir/config.toml repeats the adapter


@pytest.mark.parametrize("peft, model, expected", [
    ("r = 4", 'builtin = "tiny-gpt"', "lora.toml:3: model.peft: needs model.pretrained"),
    ("r = 4\nlora_alph = 8", None, "lora.toml:5: model.peft.lora_alph: unknown key (did you mean lora_alpha?)"),
    ('r = "8"', None, "lora.toml:4: model.peft.r: expected"),
    ('target_modules = ["q_proj", "qv_proj"]', None, "lora.toml:4: model.peft.target_modules: 'qv_proj' names no "
                                                     "module of the model"),
    ('target_modules = "layers\\\\.9\\\\..*"', None, "model.peft.target_modules: 'layers\\\\.9\\\\..*' names no module"),
    ("r = 0", None, "lora.toml:4: model.peft.r: the adapter's rank must be 1 or more, got 0"),
    ('layers_pattern = "layers"', None, "lora.toml:3: model.peft: peft's LoraConfig refused it: "),
])
def test_each_mistake_is_one_line_at_its_key(finetune_workspace, tmp_path, peft, model, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(_config(tmp_path, finetune_workspace, peft, model))
    message = str(caught.value)
    assert expected in message and "\n" not in message


def test_without_peft_installed_the_line_names_the_extra(finetune_workspace, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ConfigError, match=r"model.peft: needs the peft package: pip install 'workbench\[peft\]'"):
        load_config(_config(tmp_path, finetune_workspace, "r = 4"))


@pytest.mark.parametrize("peft, model, expected", [
    ('target_modules = ["nope"]', None, "names no module"),
    ("r = 4", 'factory = "workbench.models:TinyGPT"', "needs model.pretrained"),
    ("rank = 4", None, "model.peft.rank: unknown key"),
])
def test_workbench_run_exits_2_with_one_line_and_writes_nothing(finetune_workspace, tmp_path, capsys, peft, model,
                                                                expected):
    path = _config(tmp_path, finetune_workspace, peft, model)
    assert main(["run", str(path), "--headless"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and expected in err
    assert not (tmp_path / "out").exists()


def test_target_matching_follows_peft_rules():
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj", "lm_head"]
    assert unmatched_targets(["q_proj", "self_attn.q_proj", "lm_head"], names) == []
    assert unmatched_targets(["proj"], names) == ["proj"]  # a suffix counts only at a dot
    assert unmatched_targets(r"model\.layers\.\d+\.mlp\.up_proj", names) == []
    assert unmatched_targets("all-linear", names) == [] and unmatched_targets(None, names) == []
