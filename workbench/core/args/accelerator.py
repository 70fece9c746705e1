"""``TrainingArguments.accelerator_config``: HF's AcceleratorConfig fields, read both ways.

transformers turns the ``accelerator_config`` argument (a dict, a JSON string or a JSON file)
into an ``AcceleratorConfig`` object, so scripts read ``args.accelerator_config.split_batches``.
This one is also a read-only mapping of those fields (``dict(config)``, ``config["even_batches"]``,
``config.get(...)``), so code that treated the argument as a dict keeps working.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["AcceleratorConfig", "UNSERVED_ACCELERATOR_KEYS"]

# Fields workbench accepts only at their default, with the reason.
UNSERVED_ACCELERATOR_KEYS = {
    "use_seedable_sampler": "workbench's samplers are always seeded (seed / data_seed); leave it true",
    "gradient_accumulation_kwargs": "gradient accumulation follows gradient_accumulation_steps only",
    "use_configured_state": "the Trainer makes its own accelerate state from these arguments",
}


@dataclasses.dataclass(eq=False)
class AcceleratorConfig(Mapping):
    """The Accelerator's data-loading settings, with transformers' names and defaults."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = True
    non_blocking: bool = False
    gradient_accumulation_kwargs: dict | None = None
    use_configured_state: bool = False

    @classmethod
    def from_value(cls, value: Any) -> "AcceleratorConfig":
        """Build from what ``accelerator_config`` may hold: None, a dict, a JSON object string,
        a path to a JSON file, or an AcceleratorConfig (workbench's or transformers', read
        through its ``to_dict``). ValueError ("accelerator_config: ...") on anything else."""
        if value is None:
            return cls()
        if isinstance(value, type):
            raise ValueError("accelerator_config: got a class; pass an instance (AcceleratorConfig()) or a dict")
        if hasattr(value, "to_dict") and not isinstance(value, Mapping):
            value = value.to_dict()
        if isinstance(value, str):
            text = value.strip()
            if not text.startswith("{"):
                path = Path(text).expanduser()
                if not path.is_file():
                    raise ValueError(f"accelerator_config: {value}: no such JSON file")
                text = path.read_text(encoding="utf-8")
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"accelerator_config: not a JSON object ({exc.msg})") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"accelerator_config: expected a table, a JSON object or a JSON file, got "
                             f"{type(value).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in value if k not in names)
        if unknown:
            raise ValueError(f"accelerator_config: unknown keys {unknown}; accepted: {', '.join(names)}")
        return cls(**dict(value))

    def unserved(self) -> tuple[str, str] | None:
        """The first field set away from its default that workbench does not serve, with why."""
        defaults = type(self)()
        for name, why in UNSERVED_ACCELERATOR_KEYS.items():
            if getattr(self, name) != getattr(defaults, name):
                return name, why
        return None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict, as HF's training_args.json holds them: without
        use_configured_state, which HF's device set-up takes out of its object."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name != "use_configured_state"}

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)
