"""The ``[samples]`` table checked: answers to fixed prompts as the run trains
(workbench/train/samples.py), and whether the run's model can give them.

The table is checked with the rest of the file, located at its key like every other
problem (``x.toml:14: samples.every: expected "eval" ...``); whether the model can generate
is known only once it is built, so :func:`check_can_sample` runs at build time, and a
model that cannot is one line there too.
"""

from __future__ import annotations

from typing import Any

from workbench.config.errors import Key
from workbench.core.args.training import ArgumentError
from workbench.train.samples import SAMPLES_FIELDS, Samples, SamplesCallback

__all__ = ["SAMPLES_FIELDS", "check_can_sample", "samples_table"]

# The types a TOML value must have, key by key (TOML has no null: a key left out keeps the
# default). Samples itself checks the ranges, and names the key when one is out of range.
_HINTS: dict[str, Any] = {"prompts": list[str], "max_new_tokens": int, "every": int | str, "temperature": float,
                          "top_k": int, "seed": int, "chat": bool}


def samples_table(loader: Any, table: Any) -> Samples:
    """``[samples]`` as :class:`Samples`, with ``loader``'s (config/loader.py ``_Loader``) errors:
    one line naming the file, the line and the key."""
    key: Key = ("samples",)
    loader.table(key, table, SAMPLES_FIELDS)
    if "prompts" not in table:
        raise loader.error(key, 'missing prompts: the texts to answer, e.g. prompts = ["What is 2 plus 3?"]')
    kwargs = {name: loader.check_type(key + (name,), value, _HINTS[name]) for name, value in table.items()}
    try:
        return Samples(**kwargs)
    except ArgumentError as exc:
        raise loader.error(key + (exc.key,) if exc.key else key, exc.reason) from None


def check_can_sample(samples: Samples, model: Any, tokenizer: Any, args: Any) -> SamplesCallback:
    """The run's SamplesCallback, once its built model and tokenizer are known to answer the
    prompts; ValueError (one line, ``samples: ...``) otherwise. A model that ``model_init``
    builds later (None here) is checked when the run starts."""
    callback = SamplesCallback.from_settings(samples)
    if model is not None:
        problem = callback.problem(model, tokenizer, args)
        if problem is not None:
            raise ValueError(f"samples: {problem}")
    return callback
