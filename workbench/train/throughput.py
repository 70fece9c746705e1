"""Throughput and MFU: tokens, samples and FLOP per second over the steps since the last
log, and the model FLOP utilisation against the device's peak where it is known.

Tokens are the non-padding tokens the data path already has (``attention_mask`` summed, else
the input ids counted), accumulated on the device and read back only at logging points, as
the loss is. The same count gives the live tokens/s of the dashboard, the panel and ``ctl
status`` (session/progress.py): samples/s times :attr:`Throughput.tokens_per_sample`, the
non-padding tokens a sample of the last window. A mask is only read at a logging point, so
until the first one that figure is unknown (None) for padded batches; batches without a mask
count their input ids, a host-side number, known from the first micro-batch. FLOP come from ``Trainer.floating_point_ops``: transformers models' own count,
or 6 x parameters x tokens (forward and backward) for a model that counts its parameters;
a model with neither has no FLOP figure and no MFU. The peak is a table of common
accelerators' dense bf16/fp16 (tf32 for float32) tensor throughput, or the ``[health]
peak_tflops`` override; on the CPU, where no peak is meaningful, MFU is None rather than a
made-up figure.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["PEAK_TFLOPS", "Throughput", "device_peak_tflops"]

# Dense tensor-core TFLOP/s per device: (name as torch reports it, contains) -> {dtype: peak}.
# bf16 and fp16 share a figure; float32 runs on tf32 tensor cores where it may.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp32": 494.5},
    "H100": {"bf16": 989.0, "fp32": 494.5},  # SXM; the PCIe card is lower (756), named "H100 PCIe"
    "H100 PCIe": {"bf16": 756.0, "fp32": 378.0},
    "GH200": {"bf16": 989.0, "fp32": 494.5},
    "B200": {"bf16": 2250.0, "fp32": 1100.0},
    "A100": {"bf16": 312.0, "fp32": 156.0},
    "A10G": {"bf16": 70.0, "fp32": 35.0},
    "A10": {"bf16": 125.0, "fp32": 62.5},
    "L40S": {"bf16": 362.0, "fp32": 183.0},
    "L4": {"bf16": 121.0, "fp32": 60.0},
    "V100": {"bf16": 125.0, "fp32": 15.7},  # fp16 tensor cores; no bf16, no tf32
    "T4": {"bf16": 65.0, "fp32": 8.1},
    "RTX 4090": {"bf16": 165.0, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "fp32": 35.6},
}


def device_peak_tflops(device: torch.device, mixed_precision: str | None, override: float | None = None) -> float | None:
    """The peak dense TFLOP/s of ``device`` for this run's precision: the override, else the
    table by the device's name (the longest matching entry), else None (the CPU, unknown cards)."""
    if override:
        return float(override)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    matches = [key for key in PEAK_TFLOPS if key in name]
    if not matches:
        return None
    entry = PEAK_TFLOPS[max(matches, key=len)]
    return entry["bf16" if mixed_precision in ("bf16", "fp16") else "fp32"]


class Throughput:
    """Counts what each micro-batch brings and turns it into rates at each logging point."""

    def __init__(self) -> None:
        self.peak_tflops: float | None = None
        self.latest: dict[str, float] = {}  # the newest rates (the Session and events.jsonl read them)
        # Non-padding tokens a sample in the last window: the live tokens/s is samples/s times it.
        self.tokens_per_sample: float | None = None
        self._tokens: torch.Tensor | None = None
        self._counted = False
        self._samples = 0
        self._flos = 0.0
        self._since = time.perf_counter()

    def start(self, device: torch.device, peak_tflops: float | None) -> None:
        """A train() begins: counts from zero, the device's peak known."""
        self.peak_tflops = peak_tflops
        self._tokens = torch.zeros((), dtype=torch.long, device=device)
        self._counted, self._samples, self._flos = False, 0, 0.0
        self.tokens_per_sample = None
        self._since = time.perf_counter()

    def add(self, inputs: Any, samples: int, flos: float) -> None:
        """One micro-batch: its tokens (on the device, no sync), samples and FLOP."""
        self._samples += samples
        self._flos += flos
        if isinstance(inputs, Mapping) and self._tokens is not None:
            mask = inputs.get("attention_mask")
            if isinstance(mask, torch.Tensor):
                tokens: torch.Tensor | int = mask.sum().to(self._tokens.device)
            elif isinstance(inputs.get("input_ids"), torch.Tensor):
                tokens = inputs["input_ids"].numel()
            else:
                return
            self._tokens += tokens
            self._counted = True
            if self.tokens_per_sample is None and samples and isinstance(tokens, int):
                self.tokens_per_sample = tokens / samples  # input ids counted on the host: no sync

    def window(self, exclude_seconds: float = 0.0) -> dict[str, float]:
        """Rates since the last window (a logging point: reading the tokens is a host sync).

        ``exclude_seconds``: time in between that was not training (evaluation, saves, a
        pause), left out of the rates.
        """
        now = time.perf_counter()
        seconds = max(now - self._since - exclude_seconds, 1e-9)
        out: dict[str, float] = {"train_samples_per_second": round(self._samples / seconds, 3)}
        if self._counted and self._tokens is not None:
            tokens = int(self._tokens)
            out["train_tokens_per_second"] = round(tokens / seconds, 3)
            if self._samples:
                self.tokens_per_sample = tokens / self._samples
            self._tokens.zero_()
        if self._flos:
            out["train_flops_per_second"] = self._flos / seconds
            if self.peak_tflops:
                out["mfu"] = round(out["train_flops_per_second"] / (self.peak_tflops * 1e12), 4)
        self._samples, self._flos, self._counted = 0, 0.0, False
        self._since = now
        self.latest = out
        return out
