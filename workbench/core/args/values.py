"""Reading and checking the values of single TrainingArguments fields.

Kept apart from args.py, which holds the fields and the rules that tie them together.
Each checker raises :class:`ArgumentError`, whose ``key`` names the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["ArgumentError", "FSDP_SHARDING", "FSDP_OPTIONS", "check_steps", "fsdp_options", "json_file",
           "typed_strings", "json_or_dict", "is_multiple", "learning_rate_problem", "check_learning_rate"]


class ArgumentError(ValueError):
    """A training argument is invalid; ``key`` names it (None for a combination)."""

    def __init__(self, key: str | None, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.reason = message


def check_steps(name: str, value: float | None) -> None:
    """HF rule for *_steps: a positive int, or a float in (0, 1) meaning a ratio of max_steps."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(name, f"expected an int or a float ratio in (0, 1), got {value!r}")
    if value <= 0:
        raise ArgumentError(name, f"must be > 0, got {value}")
    if value > 1 and float(value) != int(value):
        raise ArgumentError(name, f"values above 1 must be whole numbers of steps, got {value}")


FSDP_SHARDING = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")
FSDP_OPTIONS = (*FSDP_SHARDING, "offload", "auto_wrap")


def fsdp_options(value: Any) -> list[str] | None:
    """HF's ``fsdp`` option string ("full_shard auto_wrap") or list, checked, as a list (None: unset)."""
    if value in (None, "", False) or value == []:
        return None
    if value is True:
        return ["full_shard"]
    words = value.split() if isinstance(value, str) else [str(getattr(v, "value", v)) for v in value]
    unknown = [w for w in words if w not in FSDP_OPTIONS]
    if unknown:
        raise ArgumentError("fsdp", f"unknown option(s) {', '.join(unknown)}; use any of: {', '.join(FSDP_OPTIONS)}")
    if sum(w in FSDP_SHARDING for w in words) > 1:
        raise ArgumentError("fsdp", f"choose one sharding strategy of: {', '.join(FSDP_SHARDING)}")
    return words


def json_file(name: str, value: Any) -> Any:
    """A path to a JSON file (as HF accepts for fsdp_config / deepspeed) becomes its text."""
    if isinstance(value, str) and value.strip().endswith(".json") and not value.lstrip().startswith("{"):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ArgumentError(name, f"{value}: no such JSON file")
        return path.read_text(encoding="utf-8")
    return value


def typed_strings(value: dict) -> dict:
    """HF's reading of a JSON object given as text: string values "true"/"false" become
    booleans and numeric strings ("3", "0.5") numbers, in nested objects too."""
    out = {}
    for key, item in value.items():
        if isinstance(item, dict):
            item = typed_strings(item)
        elif isinstance(item, str):
            if item.lower() in ("true", "false"):
                item = item.lower() == "true"
            elif item.isdigit():
                item = int(item)
            elif item.replace(".", "", 1).isdigit():
                item = float(item)
        out[key] = item
    return out


def json_or_dict(name: str, value: Any) -> dict | None:
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ArgumentError(name, f"expected a table or a JSON object string ({exc.msg})") from None
        if not isinstance(parsed, dict):
            raise ArgumentError(name, "expected a JSON object")
        return parsed
    raise ArgumentError(name, f"expected a table or a JSON object string, got {type(value).__name__}")


def is_multiple(save_steps: float, eval_steps: float | None) -> bool:
    if eval_steps is None:
        return True
    if save_steps < 1 or eval_steps < 1:
        ratio = save_steps / eval_steps
        return abs(ratio - round(ratio)) < 1e-9 and round(ratio) >= 1
    return int(save_steps) % int(eval_steps) == 0


def learning_rate_problem(value: Any) -> str | None:
    """What is wrong with ``value`` as a learning rate, or None if it is fine.

    The one rule for a learning rate, wherever one is set: TrainingArguments, a live edit
    (Session.set, the dashboard's form, the notebook's field), a branch's override. A finite
    number >= 0 (0 freezes the weights, a legitimate experiment); NaN and infinities are
    refused because a single NaN step poisons every weight for the rest of the run.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return f"expected a finite number >= 0 (e.g. 1e-4), got {value!r}"
    return None


def check_learning_rate(value: Any) -> None:
    """Raise ValueError ("learning_rate: ...") unless ``value`` is a valid learning rate."""
    problem = learning_rate_problem(value)
    if problem is not None:
        raise ValueError(f"learning_rate: {problem}")
