"""The names of what a run writes into its output_dir, in one place (the checkpoint format
and the output directory the README documents)."""

from __future__ import annotations

__all__ = ["PREFIX_CHECKPOINT_DIR", "MANIFEST", "SENTINEL", "WEIGHTS", "WEIGHTS_INDEX", "TRAINER_STATE_NAME",
           "WORKBENCH_STATE_NAME", "EVENTS_FILE", "CONTROL_FILE", "LOCK_NAME"]

PREFIX_CHECKPOINT_DIR = "checkpoint"  # checkpoint-<step>/, as transformers names them
MANIFEST = "manifest.json"  # written last: a checkpoint without it is incomplete
SENTINEL = "checkpoint-is-incomplete.txt"  # present while a checkpoint is being written
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # sharded weights
TRAINER_STATE_NAME = "trainer_state.json"  # HF's TrainerState fields only
WORKBENCH_STATE_NAME = "workbench_state.json"  # what workbench adds: live edits, loss window, guard, position
EVENTS_FILE = "events.jsonl"  # every log, evaluation, save, edit, guard record and the end, one a line
CONTROL_FILE = "control.json"  # while a run is live: where its control endpoint listens
LOCK_NAME = ".lock"  # one writer per output_dir
