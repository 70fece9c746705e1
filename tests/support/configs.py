"""Config files written for a test, and the error loading one gives."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from workbench.config.loader import ConfigError, load_config

HEAD = """\
run_name = "t"
[model]
builtin = "tiny-gpt"
[data]
builtin = "python-source"
"""  # 5 lines: tests append from line 6 on


def write(folder: Path, text: str, name: str = "c.toml") -> Path:
    """``text`` (dedented) written to ``folder/name``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path: Path, overrides=None) -> str:
    """The ConfigError message loading ``path`` (with ``overrides``) raises."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


# A user module the configs refer to (hooks = "module:name").
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
