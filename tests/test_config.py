"""Config loading: every error path is located (file:line: key) and worded for a user."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from workbench.config.toml_lines import find_lines, line_of
from workbench.core.args.training import TrainingArguments
from workbench.config.loader import (
    ConfigError,
    config_from_dict,
    dump_config,
    load_config,
    parse_override,
    starter_config_text,
    write_resolved_config,
)

HEAD = """\
run_name = "t"
[model]
builtin = "tiny-gpt"
[data]
builtin = "python-source"
"""  # 5 lines: tests append from line 6 on


def write(folder: Path, text: str, name: str = "c.toml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path: Path, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


# -- ConfigError shape -------------------------------------------------------------------


def test_config_error_formats_one_line_with_optional_parts():
    err = ConfigError("unknown key (did you mean learning_rate?)", path="examples/x.toml", line=7,
                      key="training.learnig_rate")
    assert str(err) == "examples/x.toml:7: training.learnig_rate: unknown key (did you mean learning_rate?)"
    assert (err.path, err.line, err.key) == ("examples/x.toml", 7, "training.learnig_rate")
    assert str(ConfigError("boom", path="x.toml", key="model")) == "x.toml: model: boom"
    assert str(ConfigError("boom", path="x.toml")) == "x.toml: boom"
    assert isinstance(err, ValueError) and "\n" not in str(err)


# -- unknown keys ------------------------------------------------------------------------


def test_unknown_top_level_key_did_you_mean(tmp_path):
    p = write(tmp_path, 'run_nme = "x"\n' + HEAD.replace('run_name = "t"\n', ""))
    assert error_of(p) == f"{p}:1: run_nme: unknown key (did you mean run_name?)"


def test_unknown_top_level_table_lists_choices(tmp_path):
    p = write(tmp_path, HEAD + "[extras]\nx = 1\n")
    assert error_of(p) == f"{p}:6: extras: unknown key (expected one of: run_name, model, data, training, hooks, guard)"


def test_unknown_training_key_did_you_mean(tmp_path):
    p = write(tmp_path, HEAD + "[training]\nmax_steps = 3\nlearnig_rate = 1e-3\n")
    assert error_of(p) == f"{p}:8: training.learnig_rate: unknown key (did you mean learning_rate?)"


def test_unknown_training_key_common_short_names(tmp_path):
    p = write(tmp_path, HEAD + "[training]\nlr = 1e-3\n")
    assert error_of(p) == f"{p}:7: training.lr: unknown key (did you mean learning_rate?)"
    assert error_of(write(tmp_path, HEAD), ["training.batch_size=4"]) == (
        "--set training.batch_size=4: training.batch_size: unknown key (did you mean per_device_train_batch_size?)")


def test_unknown_training_key_without_close_match(tmp_path):
    p = write(tmp_path, HEAD + "[training]\nzzz = 1\n")
    assert error_of(p) == f"{p}:7: training.zzz: unknown key (not a field of TrainingArguments)"


def test_unknown_model_key(tmp_path):
    p = write(tmp_path, '[model]\nbuiltin = "tiny-gpt"\noptins = {}\n[data]\nbuiltin = "python-source"\n')
    assert error_of(p) == f"{p}:3: model.optins: unknown key (did you mean options?)"


def test_unknown_data_key(tmp_path):
    p = write(tmp_path, '[model]\nbuiltin = "tiny-gpt"\n[data]\nbuiltin = "python-source"\n\nevl = 1\n')
    assert error_of(p) == f"{p}:6: data.evl: unknown key (did you mean eval?)"


def test_unknown_hooks_key(tmp_path):
    p = write(tmp_path, HEAD + '[hooks]\ncompute_metric = "x:y"\n')
    assert error_of(p) == f"{p}:7: hooks.compute_metric: unknown key (did you mean compute_metrics?)"


def test_unknown_model_option_checked_against_the_builtin_signature(tmp_path):
    p = write(tmp_path, '[model]\nbuiltin = "tiny-gpt"\n[model.options]\nn_layers = 2\n'
                        '[data]\nbuiltin = "python-source"\n')
    assert error_of(p) == f"{p}:4: model.options.n_layers: unknown key (did you mean n_layer?)"


def test_model_option_type_checked(tmp_path):
    p = write(tmp_path, '[model]\nbuiltin = "tiny-gpt"\noptions = { n_layer = "2" }\n'
                        '[data]\nbuiltin = "python-source"\n')
    assert error_of(p) == (f'{p}:3: model.options.n_layer: expected an integer, got "2" (a string); '
                           "write n_layer = 2")


def test_unknown_data_option(tmp_path):
    p = write(tmp_path, HEAD + "[data.options]\nblock_size = 64\nmax_char = 10\n")
    assert error_of(p) == f"{p}:8: data.options.max_char: unknown key (did you mean max_chars?)"


# -- wrong types -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('max_steps = "10"', 'training.max_steps: expected an integer, got "10" (a string); write max_steps = 10'),
        ("max_steps = true", "training.max_steps: expected an integer, got true (a boolean)"),
        ('lr_scheduler_type = ["cosine"]', 'training.lr_scheduler_type: expected a string, got ["cosine"] (a list)'),
        ('learning_rate = "1e-4"',
         'training.learning_rate: expected a number, got "1e-4" (a string); write learning_rate = 1e-4'),
        ("learning_rate = false", "training.learning_rate: expected a number, got false (a boolean)"),
        ("bf16 = 1", "training.bf16: expected true or false, got 1 (an integer)"),
        ('bf16 = "true"', 'training.bf16: expected true or false, got "true" (a string); write bf16 = true'),
        ('save_total_limit = "two"', 'training.save_total_limit: expected an integer, got "two" (a string)'),
        ("report_to = [1]", "training.report_to: expected a string or a list of strings, got [1] (a list)"),
        ("output_dir = 3", "training.output_dir: expected a string, got 3 (an integer)"),
    ],
)
def test_wrong_types_are_named_with_expected_and_given(tmp_path, line, expected):
    p = write(tmp_path, HEAD + "[training]\nseed = 5\n" + line + "\n")
    assert error_of(p) == f"{p}:8: {expected}"


def test_ints_are_fine_for_float_fields(tmp_path):
    p = write(tmp_path, HEAD + "[training]\nlearning_rate = 1\nnum_train_epochs = 2\n")
    args = load_config(p).training
    assert args.learning_rate == 1.0 and args.num_train_epochs == 2.0


def test_run_name_and_tables_must_have_the_right_shape(tmp_path):
    p = write(tmp_path, 'run_name = 3\n' + HEAD.replace('run_name = "t"\n', ""))
    assert error_of(p) == f"{p}:1: run_name: expected a non-empty string, got 3 (an integer)"
    p = write(tmp_path, 'training = 3\n' + HEAD)
    assert error_of(p) == f"{p}:1: training: expected a table, got 3 (an integer)"


# -- TrainingArguments validation mapped to lines ----------------------------------------


def test_load_best_model_at_end_mismatch_points_at_its_line(tmp_path):
    p = write(tmp_path, HEAD + textwrap.dedent("""\
        [training]
        eval_strategy = "steps"
        save_strategy = "epoch"
        load_best_model_at_end = true
        max_steps = 10
        """))
    assert error_of(p) == (
        f"{p}:9: training.load_best_model_at_end: requires save_strategy to match eval_strategy "
        "(save_strategy='epoch', eval_strategy='steps'), or save_strategy=\"best\""
    )


def test_bad_optimizer_lists_the_supported_names(tmp_path):
    p = write(tmp_path, HEAD + '[training]\noptim = "adamw_foo"\n')
    message = error_of(p)
    assert message.startswith(f"{p}:7: training.optim: 'adamw_foo' is not one of: ")
    for name in ("adamw_torch", "adamw_torch_fused", "sgd", "adafactor"):
        assert name in message


def test_combination_without_a_key_points_at_the_training_header(tmp_path):
    p = write(tmp_path, HEAD + "\n[training]\nbf16 = true\nfp16 = true\n")
    assert error_of(p) == f"{p}:7: training: fp16 and bf16 are both set: choose one mixed-precision mode"


def test_error_on_a_derived_key_falls_back_to_the_training_header(tmp_path):
    # eval_on_start's problem is the (defaulted) eval_strategy; the key is in the file
    p = write(tmp_path, HEAD + "[training]\nmax_steps = 3\neval_on_start = true\n")
    assert error_of(p) == f'{p}:8: training.eval_on_start: evaluates before training, so eval_strategy must not be "no"'


def test_unserved_field_is_rejected_with_the_reason(tmp_path):
    p = write(tmp_path, HEAD + "[training]\npush_to_hub = true\n")
    assert error_of(p).startswith(f"{p}:7: training.push_to_hub: not supported: the Hugging Face Hub")


def test_value_rules_from_training_arguments(tmp_path):
    p = write(tmp_path, HEAD + "[training]\nmax_steps = 0\n")
    assert error_of(p) == (f"{p}:7: training.max_steps: must be a positive integer, or -1 to use "
                           "num_train_epochs; got 0")


# -- references ----------------------------------------------------------------------------


HOOKS_PY = """\
import torch

VALUE = 3


def compute_metrics(eval_pred):
    return {"answer": 42}


class Namespace:
    @staticmethod
    def loss(outputs, labels, num_items_in_batch=None):
        return outputs.sum()


class Notify:
    def on_step_end(self, args, state, control, **kwargs):
        pass


notify = Notify()
"""


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("nosuch_pkg_xyz.hookz:token_loss",
         "hooks.compute_metrics: cannot import module 'nosuch_pkg_xyz.hookz' (No module named 'nosuch_pkg_xyz')"),
        ("hooks_a:nope", "hooks.compute_metrics: module 'hooks_a' has no attribute 'nope'"),
        ("hooks_a:Namespace.nope", "hooks.compute_metrics: hooks_a:Namespace has no attribute 'nope'"),
        ("hooks_a:VALUE", "hooks.compute_metrics: 'hooks_a:VALUE' is not callable (it is an integer)"),
        ("hooks_a.compute_metrics", 'hooks.compute_metrics: \'hooks_a.compute_metrics\' must look like '
                                    '"module:attribute" (e.g. "hooks:compute_metrics")'),
        ("hooks_a:", 'hooks.compute_metrics: \'hooks_a:\' must look like "module:attribute" '
                     '(e.g. "hooks:compute_metrics")'),
        ("missing.py:f", "hooks.compute_metrics: cannot import module 'missing.py' (file "),
    ],
)
def test_bad_references(tmp_path, ref, message):
    (tmp_path / "hooks_a.py").write_text(HOOKS_PY)
    p = write(tmp_path, HEAD + f'[hooks]\ncompute_loss_func = "hooks_a:Namespace.loss"\ncompute_metrics = "{ref}"\n')
    assert error_of(p).startswith(f"{p}:8: {message}")


def test_hook_module_that_crashes_on_import_is_a_config_error(tmp_path):
    (tmp_path / "hooks_boom.py").write_text("raise RuntimeError('no GPU here')\n")
    p = write(tmp_path, HEAD + '[hooks]\ncompute_metrics = "hooks_boom:f"\n')
    assert error_of(p) == f"{p}:7: hooks.compute_metrics: cannot import module 'hooks_boom' (RuntimeError: no GPU here)"


def test_callbacks_must_be_a_list_of_callback_refs(tmp_path):
    (tmp_path / "hooks_cb.py").write_text(HOOKS_PY)
    p = write(tmp_path, HEAD + '[hooks]\ncallbacks = "hooks_cb:Notify"\n')
    assert error_of(p) == (f'{p}:7: hooks.callbacks: expected a list of "module:attribute" strings, '
                           'got "hooks_cb:Notify" (a string)')
    p = write(tmp_path, HEAD + '[hooks]\ncallbacks = ["hooks_cb:Notify", "hooks_cb:compute_metrics"]\n')
    assert error_of(p) == (f"{p}:7: hooks.callbacks: 'hooks_cb:compute_metrics' is not a callback "
                           "(a TrainerCallback class or instance)")


def test_hooks_resolve_from_a_module_next_to_the_config(tmp_path, monkeypatch):
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "hooks.py").write_text(HOOKS_PY)
    monkeypatch.chdir(tmp_path)  # the module is not importable from the working directory
    p = write(folder, HEAD + textwrap.dedent("""\
        [hooks]
        compute_metrics = "hooks:compute_metrics"
        compute_loss_func = "hooks:Namespace.loss"
        callbacks = ["hooks:Notify", "hooks:notify"]
        """))
    path_before = list(sys.path)
    config = load_config(p)
    assert sys.path == path_before  # the config's folder was put on sys.path only for the import
    assert config.hooks["compute_metrics"](None) == {"answer": 42}
    assert config.hooks["compute_loss_func"].__qualname__ == "Namespace.loss"
    notify_cls, notify = config.hooks["callbacks"]
    assert isinstance(notify_cls, type) and isinstance(notify, notify_cls)
    assert config.hook_refs == {"compute_metrics": "hooks:compute_metrics",
                                "compute_loss_func": "hooks:Namespace.loss",
                                "callbacks": ["hooks:Notify", "hooks:notify"]}
    # recorded by absolute file, so output_dir/config.toml imports the same code from anywhere
    assert config.raw["hooks"]["compute_metrics"] == f"{folder / 'hooks.py'}:compute_metrics"


def test_a_second_config_gets_its_own_hooks_module(tmp_path):
    results = []
    for answer in (1, 2):
        folder = tmp_path / f"p{answer}"
        folder.mkdir()
        (folder / "hooks.py").write_text(f"def compute_metrics(p):\n    return {answer}\n")
        p = write(folder, HEAD + '[hooks]\ncompute_metrics = "hooks:compute_metrics"\n')
        results.append(load_config(p).hooks["compute_metrics"](None))
    assert results == [1, 2]


def test_installed_modules_resolve_from_the_working_directory_and_are_recorded_as_is(tmp_path):
    p = write(tmp_path, HEAD + '[hooks]\ndata_collator = "workbench.config.loader:parse_override"\n')
    config = load_config(p)
    assert config.hooks["data_collator"] is parse_override
    assert config.raw["hooks"]["data_collator"] == "workbench.config.loader:parse_override"


def test_file_path_references_keep_their_package(tmp_path):
    pkg = tmp_path / "pkg_ref_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "metrics.py").write_text("from . import helper\ndef f(p):\n    return helper.X\n")
    (pkg / "helper.py").write_text("X = 'from the package'\n")
    p = write(tmp_path, HEAD + '[hooks]\ncompute_metrics = "pkg_ref_test/metrics.py:f"\n')
    assert load_config(p).hooks["compute_metrics"](None) == "from the package"


# -- model -------------------------------------------------------------------------------


def test_model_needs_exactly_one_kind(tmp_path):
    p = write(tmp_path, '[model]\noptions = {}\n[data]\nbuiltin = "python-source"\n')
    assert error_of(p) == f"{p}:1: model: set exactly one of builtin, factory, pretrained"
    p = write(tmp_path, '[model]\nbuiltin = "tiny-gpt"\nfactory = "m:f"\n[data]\nbuiltin = "python-source"\n')
    assert error_of(p) == (f"{p}:3: model.factory: set exactly one of builtin, factory, pretrained "
                           "(builtin and factory are both set)")


def test_unknown_builtin_model(tmp_path):
    p = write(tmp_path, '[model]\nbuiltin = "tiny-gtp"\n[data]\nbuiltin = "python-source"\n')
    assert error_of(p) == (f"{p}:2: model.builtin: unknown builtin model 'tiny-gtp' (did you mean tiny-gpt?); "
                           "available: mlp, tiny-gpt")


def test_pretrained_must_be_a_local_folder(tmp_path):
    p = write(tmp_path, '[model]\npretrained = "gpt2"\n[data]\nbuiltin = "python-source"\n')
    assert error_of(p) == (f"{p}:2: model.pretrained: folder 'gpt2' does not exist; downloading from the Hub "
                           "is not supported, point to a local folder")
    (tmp_path / "weights").mkdir()
    p = write(tmp_path, '[model]\npretrained = "weights"\n[data]\nbuiltin = "python-source"\n')
    config = load_config(p)
    assert config.model.pretrained == str(tmp_path / "weights")
    assert config.raw["model"]["pretrained"] == str(tmp_path / "weights")


def test_factory_is_resolved_and_its_options_checked(tmp_path):
    (tmp_path / "models_f.py").write_text("def build(width: int = 4):\n    return ('model', width)\n")
    p = write(tmp_path, '[model]\nfactory = "models_f:build"\noptions = { width = 8 }\n'
                        '[data]\nbuiltin = "random-classification"\n')
    spec = load_config(p).model
    assert spec.factory == "models_f:build" and spec.factory_fn(**spec.options) == ("model", 8)
    p = write(tmp_path, '[model]\nfactory = "models_f:build"\noptions = { widht = 8 }\n'
                        '[data]\nbuiltin = "random-classification"\n')
    assert error_of(p) == f"{p}:3: model.options.widht: unknown key (did you mean width?)"


# -- data --------------------------------------------------------------------------------


def test_data_needs_builtin_or_train(tmp_path):
    p = write(tmp_path, '[model]\nbuiltin = "tiny-gpt"\n[data]\noptions = {}\n')
    assert error_of(p).startswith(f'{p}:3: data: set builtin (e.g. builtin = "python-source") or train')


def test_builtin_data_cannot_take_train_or_eval(tmp_path):
    p = write(tmp_path, HEAD + 'train = { path = "json" }\n')
    assert error_of(p).startswith(f"{p}:6: data.train: cannot be combined with builtin")


def test_unknown_builtin_data(tmp_path):
    p = write(tmp_path, '[model]\nbuiltin = "tiny-gpt"\n[data]\nbuiltin = "python-sauce"\n')
    assert error_of(p) == (f"{p}:4: data.builtin: unknown builtin data set 'python-sauce' "
                           "(did you mean python-source?); available: python-source, random-classification")


def test_relative_data_files_and_output_dir_resolve_against_the_config_folder(tmp_path, monkeypatch):
    folder = tmp_path / "cfg"
    (folder / "data").mkdir(parents=True)
    for name in ("train.jsonl", "a.jsonl", "b.jsonl", "test.jsonl"):
        (folder / "data" / name).write_text('{"text": "x"}\n')
    (folder / "local_builder").mkdir()
    monkeypatch.chdir(tmp_path)
    p = write(folder, textwrap.dedent("""\
        [model]
        builtin = "tiny-gpt"
        [data]
        train = { path = "json", data_files = "data/train.jsonl" }
        [data.eval.first]
        path = "json"
        data_files = ["data/a.jsonl", "data/b.jsonl"]
        [data.eval.second]
        path = "local_builder"
        data_files = { test = "data/*.jsonl" }
        [training]
        output_dir = "runs/x"
        """))
    config = load_config(p)
    d = folder / "data"
    assert config.data.train == {"path": "json", "data_files": str(d / "train.jsonl")}
    assert config.data.eval == {
        "first": {"path": "json", "data_files": [str(d / "a.jsonl"), str(d / "b.jsonl")]},
        "second": {"path": str(folder / "local_builder"), "data_files": {"test": str(d / "*.jsonl")}},
    }
    assert config.training.output_dir == str(folder / "runs" / "x")
    assert config.raw["training"]["output_dir"] == str(folder / "runs" / "x")
    assert config.raw["data"]["train"]["data_files"] == str(d / "train.jsonl")


def test_single_eval_table_and_missing_files(tmp_path):
    (tmp_path / "t.jsonl").write_text("{}\n")
    p = write(tmp_path, '[model]\nbuiltin = "tiny-gpt"\n[data]\ntrain = { path = "json", data_files = "t.jsonl" }\n'
                        'eval = { path = "json", data_files = "t.jsonl" }\n')
    assert load_config(p).data.eval == {"path": "json", "data_files": str(tmp_path / "t.jsonl")}
    p = write(tmp_path, '[model]\nbuiltin = "tiny-gpt"\n[data]\ntrain = { path = "json", data_files = "t.jsonl" }\n'
                        '[data.eval]\npath = "json"\ndata_files = "nope.jsonl"\n')
    assert error_of(p) == (f"{p}:7: data.eval.data_files: file 'nope.jsonl' does not exist "
                           f"(looked for {tmp_path / 'nope.jsonl'})")
    p = write(tmp_path, '[model]\nbuiltin = "tiny-gpt"\n[data]\ntrain = { data_files = "t.jsonl" }\n')
    assert error_of(p).startswith(f"{p}:4: data.train: missing path")
    p = write(tmp_path, '[model]\nbuiltin = "tiny-gpt"\n[data]\ntrain = { path = "json", data_files = "x/*.csv" }\n')
    assert error_of(p) == f"{p}:4: data.train.data_files: no file matches 'x/*.csv' (looked in {tmp_path / 'x'})"


def test_omitted_output_dir_defaults_next_to_the_config(tmp_path):
    config = load_config(write(tmp_path, HEAD))
    assert config.training.output_dir == str(tmp_path / "trainer_output")
    assert config.training.run_name == "t" and config.run_name == "t"


# -- missing tables, syntax errors ---------------------------------------------------------


def test_empty_file_lists_the_required_tables(tmp_path):
    p = write(tmp_path, "")
    assert error_of(p) == f"{p}: missing required tables [model], [data]; run 'workbench init' for a starter config"


def test_missing_data_table(tmp_path):
    p = write(tmp_path, '[model]\nbuiltin = "tiny-gpt"\n')
    assert error_of(p) == f"{p}: missing required table [data]; run 'workbench init' for a starter config"


def test_toml_syntax_error_reports_the_line(tmp_path):
    p = write(tmp_path, HEAD + "[training]\nlearning_rate = 3e-4\nmax_steps = \n")
    message = error_of(p)
    assert message.startswith(f"{p}:8: invalid TOML: ") and "\n" not in message


def test_missing_file(tmp_path):
    assert error_of(tmp_path / "none.toml") == f"{tmp_path / 'none.toml'}: config file not found"


# -- overrides -----------------------------------------------------------------------------


def test_parse_override_reads_toml_values_or_plain_strings():
    assert parse_override("training.learning_rate=1e-4") == ("training.learning_rate", 1e-4)
    assert parse_override('training.report_to=["jsonl"]') == ("training.report_to", ["jsonl"])
    assert parse_override("run_name=my-run") == ("run_name", "my-run")
    assert parse_override("model.options.n_layer = 4") == ("model.options.n_layer", 4)
    assert parse_override("training.eval_on_start=true") == ("training.eval_on_start", True)
    assert parse_override("training.output_dir=runs/a b") == ("training.output_dir", "runs/a b")
    with pytest.raises(ConfigError) as info:
        parse_override("training.learning_rate")
    assert str(info.value) == "--set training.learning_rate: expected KEY=VALUE (e.g. training.learning_rate=1e-4)"


def test_valid_overrides_change_values(tmp_path):
    p = write(tmp_path, HEAD + "[training]\nlearning_rate = 3e-4\n")
    config = load_config(p, ["training.learning_rate=1e-4", 'training.report_to=["jsonl"]',
                             "run_name=x", "model.options.n_layer=4", "training.max_steps=7"])
    assert config.training.learning_rate == 1e-4 and config.training.report_to == ["jsonl"]
    assert config.run_name == "x" and config.training.run_name == "x"
    assert config.model.options == {"n_layer": 4} and config.training.max_steps == 7
    assert config.raw["training"]["learning_rate"] == 1e-4


def test_mapping_overrides_and_none_restores_the_default(tmp_path):
    p = write(tmp_path, HEAD + "[training]\nmax_steps = 9\nsave_total_limit = 3\n")
    config = load_config(p, {"training.max_steps": 4, "training.save_total_limit": None})
    assert config.training.max_steps == 4 and config.training.save_total_limit is None
    with pytest.raises(ConfigError) as info:
        load_config(p, {"training.max_steps": "4"})
    assert str(info.value) == ('--set training.max_steps="4": training.max_steps: expected an integer, '
                               'got "4" (a string); write max_steps = 4')


def test_invalid_override_is_located_at_set(tmp_path):
    p = write(tmp_path, HEAD + "[training]\nmax_steps = 3\n")
    assert error_of(p, ["training.max_steps=abc"]) == (
        '--set training.max_steps=abc: training.max_steps: expected an integer, got "abc" (a string)')
    assert error_of(p, ["training.learnig_rate=1"]) == (
        "--set training.learnig_rate=1: training.learnig_rate: unknown key (did you mean learning_rate?)")
    assert error_of(p, ["modle.builtin=mlp"]) == (
        "--set modle.builtin=mlp: modle: unknown key (did you mean model?)")
    assert error_of(p, ["run_name.x=1"]) == "--set run_name.x=1: run_name: is not a table, so it has no key 'x'"


def test_override_creating_a_combination_error_points_at_the_override(tmp_path):
    p = write(tmp_path, HEAD + '[training]\nmax_steps = 3\neval_strategy = "steps"\n')
    assert error_of(p, ["training.load_best_model_at_end=true", 'training.save_strategy="epoch"']).startswith(
        "--set training.load_best_model_at_end=true: training.load_best_model_at_end: requires save_strategy")


# -- dump and round trip -------------------------------------------------------------------


def test_dump_config_round_trips(tmp_path, monkeypatch):
    folder = tmp_path / "cfg"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "t.jsonl").write_text("{}\n")
    (folder / "hooks.py").write_text(HOOKS_PY)
    p = write(folder, textwrap.dedent("""\
        run_name = "round"
        [model]
        builtin = "tiny-gpt"
        options = { n_layer = 1 }
        [data]
        train = { path = "json", data_files = { train = "data/t.jsonl" } }
        [data.eval.a]
        path = "json"
        data_files = "data/t.jsonl"
        [training]
        output_dir = "out"
        learning_rate = 1e-3
        eval_strategy = "steps"
        eval_steps = 5
        lr_scheduler_kwargs = { num_cycles = 0.5 }
        report_to = ["jsonl"]
        [hooks]
        compute_metrics = "hooks:compute_metrics"
        callbacks = ["hooks:Notify"]
        """))
    monkeypatch.chdir(tmp_path)
    first = load_config(p, ["training.max_steps=11"])
    written = write_resolved_config(first, first.training.output_dir)
    assert written == folder / "out" / "config.toml"
    assert tomllib.loads(written.read_text()) == tomllib.loads(dump_config(first))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    second = load_config(written)
    assert second.training.to_dict() == first.training.to_dict()
    assert second.training.max_steps == 11
    assert (second.model, second.data, second.run_name) == (first.model, first.data, first.run_name)
    assert second.hooks["compute_metrics"](None) == {"answer": 42}
    assert second.raw == first.raw


# -- starter, subclasses, imports, line locator --------------------------------------------


def test_starter_config_validates_and_every_option_is_commented(tmp_path):
    text = starter_config_text()
    config = config_from_dict(tomllib.loads(text), base_dir=tmp_path)
    args = config.training
    assert config.model.builtin == "tiny-gpt" and config.data.builtin == "python-source"
    assert "vocab_size" not in config.model.options
    assert config.data.options == {"block_size": 128, "max_chars": 400000}
    assert (args.max_steps, args.learning_rate, args.warmup_steps, args.eval_on_start) == (300, 3e-3, 0.1, True)
    assert args.output_dir == str(tmp_path / "runs" / "tiny-gpt") and args.report_to == ["jsonl"]
    option_lines = [ln for ln in text.splitlines() if ln and not ln.startswith(("#", "["))]
    assert option_lines and all("#" in ln for ln in option_lines)
    assert "# [hooks]" in text and "data_files" in text
    assert (config.guard.nonfinite, config.guard.spike, config.guard.max_interventions) == ("skip", "rollback", 5)


def test_config_from_dict_reports_its_source(tmp_path):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": {"builtin": "tiny-gpt"}}, base_dir=tmp_path, source="api")
    assert str(info.value) == "api: missing required table [data]; run 'workbench init' for a starter config"


@dataclasses.dataclass
class _MyArgs(TrainingArguments):
    temperature: float = 1.0


def test_training_arguments_subclass_fields(tmp_path):
    p = write(tmp_path, HEAD + "[training]\ntemperature = 0.5\n")
    config = load_config(p, args_cls=_MyArgs)
    assert isinstance(config.training, _MyArgs) and config.training.temperature == 0.5
    assert error_of(p) == f"{p}:7: training.temperature: unknown key (not a field of TrainingArguments)"
    with pytest.raises(ConfigError) as info:
        load_config(p, ["training.temperature=hot"], args_cls=_MyArgs)
    assert str(info.value) == ('--set training.temperature=hot: training.temperature: expected a number, '
                               'got "hot" (a string)')


def test_config_module_imports_no_front_end_or_heavy_library():
    code = ("import sys, workbench.config.loader\n"
            "bad = [m for m in ('transformers', 'textual', 'ipywidgets', 'plotext', 'datasets') if m in sys.modules]\n"
            "assert not bad, bad\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_line_locator_handles_headers_inline_tables_and_strings():
    text = textwrap.dedent('''\
        title = "a = 1"
        doc = """
        fake = 2
        [not.a.table]
        """
        [data]
        train = { path = "json", data_files = { train = "x" } }
        "quoted.key".inner = 1
        arr = [
          1, # comment ]
          { a = 1 },
        ]
        [[cbs]]
        name = "x"
        [ training ]
        learning_rate = 3e-4
        ''')
    lines = find_lines(text)
    assert lines[("title",)] == 1 and lines[("doc",)] == 2
    assert ("fake",) not in lines and ("not",) not in lines
    assert lines[("data",)] == 6 and lines[("data", "train", "data_files", "train")] == 7
    assert lines[("data", "quoted.key", "inner")] == 8 and lines[("data", "arr")] == 9
    assert lines[("cbs", "name")] == 14 and lines[("training", "learning_rate")] == 16
    assert line_of(lines, ("training", "missing")) == 15 and line_of(lines, ("nothing",)) is None


# -- data preparation keys (columns, text_column, tokenizer, max_length, packing) ----------

DATA_TRAIN = '[model]\nbuiltin = "tiny-gpt"\n[data]\ntrain = { path = "json", data_files = "t.jsonl" }\n'  # 4 lines


def test_data_preparation_keys_are_read_and_paths_resolved(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "tok").mkdir()
    p = write(tmp_path, DATA_TRAIN + 'columns = { body = "text" }\ntext_column = "text"\ntokenizer = "char"\n'
                        'max_length = 64\npacking = true\n')
    data = load_config(p).data
    assert (data.columns, data.text_column, data.tokenizer, data.max_length, data.packing) == (
        {"body": "text"}, "text", "char", 64, True)
    defaults = load_config(write(tmp_path, DATA_TRAIN)).data
    assert (defaults.columns, defaults.text_column, defaults.tokenizer, defaults.max_length, defaults.packing) == (
        {}, None, None, None, False)


@pytest.mark.parametrize("lines,message", [
    ('columns = { body = 3 }\n', "5: data.columns.body: expected the new column name (a non-empty string), got 3 (an integer)"),
    ('text_column = "t"\nmax_length = 0\n', "6: data.max_length: expected a positive integer (tokens), got 0 (an integer)"),
    ('text_column = "t"\nmax_length = "64"\n', '6: data.max_length: expected a positive integer (tokens), got "64" (a string)'),
    ('text_column = "t"\npacking = "yes"\n', '6: data.packing: expected true or false, got "yes" (a string)'),
    ('text_column = "t"\npacking = true\n', "6: data.packing: needs max_length (the block size in tokens)"),
    ('max_length = 64\n', "5: data.max_length: applies when tokenizing: set text_column (the column of text to tokenize)"),
    ('tokenizer = "nowhere"\n', "5: data.tokenizer: folder 'nowhere' does not exist; use \"char\" for the built-in "
                                "character tokenizer or a local transformers tokenizer folder"),
    ('text_colum = "t"\n', "5: data.text_colum: unknown key (did you mean text_column?)"),
])
def test_data_preparation_key_errors_are_located(tmp_path, lines, message):
    (tmp_path / "t.jsonl").write_text('{"body": "x"}\n')
    p = write(tmp_path, DATA_TRAIN + lines)
    assert error_of(p) == f"{p}:{message}"


def test_data_preparation_keys_cannot_go_with_builtin_data(tmp_path):
    p = write(tmp_path, HEAD + 'text_column = "text"\n')
    assert error_of(p) == (f"{p}:6: data.text_column: cannot be combined with builtin (builtin data sets come "
                           "tokenized)")


def test_tokenizer_folder_needs_transformers(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    # As on a machine without transformers, whether or not this one has it.
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real_find_spec(name, *a))
    (tmp_path / "t.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "tok").mkdir()
    p = write(tmp_path, DATA_TRAIN + 'tokenizer = "tok"\n')
    assert error_of(p) == (f"{p}:5: data.tokenizer: a tokenizer folder needs the transformers package "
                           "(pip install 'workbench[hf]'); or use tokenizer = \"char\"")


def test_missing_data_file_given_as_path_is_located(tmp_path):
    p = write(tmp_path, '[model]\nbuiltin = "tiny-gpt"\n[data]\ntrain = { path = "data/nope.jsonl" }\n')
    assert error_of(p) == (f"{p}:4: data.train.path: file 'data/nope.jsonl' does not exist "
                           f"(looked for {tmp_path / 'data' / 'nope.jsonl'})")


def test_new_sampling_strategies_are_accepted_and_typos_located(tmp_path):
    for strategy in ("group_by_length", "batch_rebalance"):
        p = write(tmp_path, HEAD + f'[training]\ntrain_sampling_strategy = "{strategy}"\n')
        assert load_config(p).training.train_sampling_strategy == strategy
    p = write(tmp_path, HEAD + '[training]\ntrain_sampling_strategy = "by_length"\n')
    assert error_of(p) == (f"{p}:7: training.train_sampling_strategy: 'by_length' is not one of: random, "
                           "sequential, group_by_length, batch_rebalance")
