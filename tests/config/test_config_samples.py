"""The ``[samples]`` table: checked with the rest of the file (one line naming the file, the
line and the key), kept in the resolved config, and turned into the run's SamplesCallback
once the model is built, which must be able to answer the prompts."""

from __future__ import annotations

import pytest

from workbench.config.build import build_trainer
from workbench.config.loader import dump_config, load_config
from workbench.train.samples import SamplesCallback

from support.configs import HEAD, error_of, write

RUN = HEAD + """\
[data.options]
max_chars = 4000
block_size = 32
[training]
output_dir = "out"
max_steps = 4
eval_strategy = "steps"
eval_steps = 2
report_to = "none"
"""  # 14 lines: [samples] starts on line 15

MLP = """\
run_name = "m"
[model]
builtin = "mlp"
[data]
builtin = "random-classification"
[training]
output_dir = "out"
max_steps = 2
report_to = "none"
"""


def test_a_samples_table_becomes_the_runs_samples_callback(tmp_path):
    path = write(tmp_path, RUN + '[samples]\nprompts = ["def ", "class "]\nmax_new_tokens = 8\nevery = 2\n'
                                 "temperature = 0.5\ntop_k = 5\nseed = 3\nchat = false\n")
    run = load_config(path)
    assert run.samples is not None and run.samples.prompts == ("def ", "class ")
    assert (run.samples.max_new_tokens, run.samples.every, run.samples.temperature, run.samples.top_k,
            run.samples.seed, run.samples.chat) == (8, 2, 0.5, 5, 3, False)
    assert 'prompts = [\n    "def ",\n    "class ",\n]' in dump_config(run) or 'prompts = ["def ", "class "]' in \
        dump_config(run)
    assert load_config(write(tmp_path / "again", dump_config(run))).samples == run.samples
    trainer = build_trainer(run, progress=False)
    (callback,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, SamplesCallback)]
    assert callback.settings == run.samples
    defaults = load_config(write(tmp_path / "d", RUN + '[samples]\nprompts = ["def "]\n')).samples
    assert (defaults.max_new_tokens, defaults.every, defaults.temperature, defaults.top_k, defaults.chat) == (
        32, "eval", 0.0, None, None)
    assert load_config(write(tmp_path / "n", RUN)).samples is None


@pytest.mark.parametrize("lines, line, expected", [
    ("prompts = []", 16, "samples.prompts: expected a list of 1 to 64 non-empty texts, got []"),
    ('prompts = "def "', 16, 'samples.prompts: expected a list of strings, got "def " (a string)'),
    ('prompts = ["def ", 3]', 16, "samples.prompts: expected a list of strings"),
    ('prompts = ["a", "  "]', 16, "samples.prompts: expected a list of 1 to 64 non-empty texts"),
    ('prompts = ["a", "a"]', 16, "samples.prompts: 'a' is given twice"),
    ('prompts = ["a"]\nmax_new_tokens = 0', 17, "samples.max_new_tokens: expected a whole number from 1 to 1024, got 0"),
    ('prompts = ["a"]\nmax_new_tokens = 2000', 17, "samples.max_new_tokens: expected a whole number from 1 to 1024"),
    ('prompts = ["a"]\nmax_new_tokens = "8"', 17, "samples.max_new_tokens: expected an integer, got \"8\" (a string)"),
    ('prompts = ["a"]\nevery = "epoch"', 17,
     "samples.every: expected \"eval\" (at each evaluation) or a whole number of steps >= 1, got 'epoch'"),
    ('prompts = ["a"]\nevery = -5', 17, "samples.every: expected \"eval\" (at each evaluation) or a whole number"),
    ('prompts = ["a"]\ntemperature = -0.5', 17, "samples.temperature: expected a number from 0 (greedy) to 100"),
    ('prompts = ["a"]\ntop_k = 0', 17, "samples.top_k: expected a whole number >= 1"),
    ('prompts = ["a"]\nseed = -1', 17, "samples.seed: expected a whole number >= 0"),
    ('prompts = ["a"]\nchat = "yes"', 17, "samples.chat: expected "),
    ('prompts = ["a"]\npromts = ["b"]', 17, "samples.promts: unknown key (did you mean prompts?)"),
    ("max_new_tokens = 8", 15, "samples: missing prompts: the texts to answer"),
])
def test_each_bad_samples_value_is_one_line_at_its_key(tmp_path, lines, line, expected):
    path = write(tmp_path, RUN + "[samples]\n" + lines + "\n")
    message = error_of(path)
    assert "\n" not in message and message.startswith(f"{path}:{line}: {expected}"), message


def test_samples_must_be_a_table_and_overrides_are_checked_too(tmp_path):
    assert "samples: expected a table" in error_of(write(tmp_path, RUN.replace('run_name = "t"', 'samples = 3')))
    path = write(tmp_path / "o", RUN + '[samples]\nprompts = ["a"]\n')
    assert error_of(path, ["samples.every=0"]).startswith("--set samples.every=0: samples.every: expected")
    assert load_config(path, ["samples.every=3"]).samples.every == 3


def test_samples_on_a_model_that_cannot_generate_are_one_line_at_build_time(tmp_path):
    """Known only once the model is built: an MLP classifier cannot answer prompts."""
    run = load_config(write(tmp_path, MLP + '[samples]\nprompts = ["hi"]\n'))
    with pytest.raises(ValueError) as err:
        build_trainer(run, progress=False)
    assert str(err.value) == "samples: MLPClassifier is not a causal LM with generate()"
