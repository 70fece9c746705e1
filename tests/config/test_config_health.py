"""The ``[health]`` table: hang and straggler settings, the MFU peak, OOM retries -- checked
with the rest of the file, each mistake one line at its key."""

from __future__ import annotations

import pytest

from workbench.config.build import build_trainer
from workbench.config.loader import ConfigError, load_config

BASE = """\
[model]
builtin = "mlp"
[data]
builtin = "random-classification"
[training]
output_dir = "out"
max_steps = 2
report_to = "none"
[health]
"""


def _config(tmp_path, body: str):
    path = tmp_path / "h.toml"
    path.write_text(BASE + body)
    return path


def test_the_table_reaches_the_trainer(tmp_path):
    run = load_config(_config(tmp_path, 'hang_timeout = 30\nhang_action = "stop"\npeak_tflops = 312.0\n'))
    trainer = build_trainer(run, progress=False)
    assert trainer.health.hang_timeout == 30 and trainer.health.hang_action == "stop"
    assert trainer.health.peak_tflops == 312.0 and trainer.health.oom_retries == 3


@pytest.mark.parametrize("body, expected", [
    ("hang_timeout = -5", 'h.toml:10: health.hang_timeout: expected a number >= 0, got -5'),
    ('hang_action = "abort"', 'h.toml:10: health.hang_action: expected "report" or "stop", got \'abort\''),
    ("hang_timout = 5", "h.toml:10: health.hang_timout: unknown key (did you mean hang_timeout?)"),
    ('oom_retries = "2"', "h.toml:10: health.oom_retries: expected"),
])
def test_each_mistake_is_one_line_at_its_key(tmp_path, body, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(_config(tmp_path, body + "\n"))
    assert expected in str(caught.value) and "\n" not in str(caught.value)
