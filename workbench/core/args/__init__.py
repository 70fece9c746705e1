"""TrainingArguments: HF's arguments with their names, defaults and meanings (``training.py``),
the enums and value rules they are read with (``enums.py``, ``values.py``), HF's members
scripts call (``methods.py``), the Accelerator's settings (``accelerator.py``) and the bridge
from transformers' own TrainingArguments (``hf.py``)."""

from workbench.core.args.training import ArgumentError, TrainingArguments

__all__ = ["ArgumentError", "TrainingArguments"]
