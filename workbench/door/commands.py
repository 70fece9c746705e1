"""The rules the door's commands are checked by, once, whoever sends them (the Session and
the control server alike): what a sample may ask for."""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_SAMPLE_TOKENS", "check_sample_options"]

MAX_SAMPLE_TOKENS = 1024  # new tokens one sample may ask for: a resume or stop waits for a sample to end
_MAX_TEMPERATURE = 100.0


def _bad(key: str, expected: str, value: Any) -> ValueError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return ValueError(f"sample: {key}: expected {expected}, got {shown}")


def check_sample_options(prompt: Any, max_new_tokens: Any = 64, temperature: Any = 0.8, top_k: Any = 20,
                         seed: Any = 0) -> dict[str, Any]:
    """The options of a sample, checked (one line naming the first bad one); returns them as
    sample_text takes them. The one rule, for the Session and the control server alike."""
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", "some text to continue", prompt)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or not (
            1 <= max_new_tokens <= MAX_SAMPLE_TOKENS):
        raise _bad("max_new_tokens", f"a whole number from 1 to {MAX_SAMPLE_TOKENS}", max_new_tokens)
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature != temperature
            or not 0 <= temperature <= _MAX_TEMPERATURE):
        raise _bad("temperature", f"a number from 0 (greedy) to {_MAX_TEMPERATURE:g}", temperature)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise _bad("top_k", "a whole number >= 1, or null for no limit", top_k)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise _bad("seed", "a whole number >= 0", seed)
    return {"prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": float(temperature), "top_k": top_k,
            "seed": seed}
