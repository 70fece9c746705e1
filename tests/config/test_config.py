"""Config loading: every error path is located (file:line: key) and worded for a user.

The error's shape, unknown keys, wrong types, TrainingArguments' checks mapped to lines and
references to user code; the tables one by one are in test_config_sections.py.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from workbench.config.loader import ConfigError, load_config, parse_override

from support.configs import HEAD, HOOKS_PY, error_of, write

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
    assert error_of(p) == f"{p}:6: extras: unknown key (expected one of: run_name, model, data, training, hooks, guard, samples, health)"


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
