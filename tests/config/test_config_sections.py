"""Config loading, table by table: the model and data tables, missing tables and syntax errors,
--set overrides, the dump and its round trip, the starter config, TrainingArguments subclasses,
user imports, the line locator and the data preparation keys. Every error is located
(file:line: key) and worded for a user.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import tomllib

import pytest

from workbench.config.loader import (
    ConfigError,
    config_from_dict,
    dump_config,
    load_config,
    parse_override,
    starter_config_text,
    write_resolved_config,
)
from workbench.config.toml_lines import find_lines, line_of
from workbench.core.args.training import TrainingArguments

from support import REPO
from support.configs import HEAD, HOOKS_PY, error_of, write

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
    assert args.output_dir == str(tmp_path / "runs" / "workbench") and args.report_to == ["jsonl"]
    option_lines = [ln for ln in text.splitlines() if ln and not ln.startswith(("#", "["))]
    assert option_lines and all("#" in ln for ln in option_lines)
    assert "# [hooks]" in text and "data_files" in text
    assert (config.guard.nonfinite, config.guard.spike, config.guard.max_interventions) == ("skip", "rollback", 5)


def test_starter_config_names_its_file_and_its_output_dir_follows_the_name(tmp_path):
    """`workbench init my-run.toml`: the header says `workbench run my-run.toml`, and the run
    trains into runs/my-run, not the demo's runs/tiny-gpt (issue 29, item 9)."""
    text = starter_config_text(file="my-run.toml")
    assert text.splitlines()[0].startswith("# workbench starter config (my-run.toml): `workbench run my-run.toml`")
    config = config_from_dict(tomllib.loads(text), base_dir=tmp_path)
    assert config.run_name == "my-run" and config.training.output_dir == str(tmp_path / "runs" / "my-run")
    odd = config_from_dict(tomllib.loads(starter_config_text(file='a "quoted" run.toml')), base_dir=tmp_path)
    assert odd.training.output_dir == str(tmp_path / "runs" / "a-quoted-run")


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
    env = dict(os.environ, PYTHONPATH=str(REPO))
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
    ('max_length = 64\n', "5: data.max_length: applies when tokenizing: set text_column (the column of text to tokenize) "
                          'or format ("messages" or "prompt-completion" rows)'),
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
