"""Memory reports: exact tensor bytes (parameters, gradients, optimizer state) plus device
and host figures, and HF's ``skip_memory_metrics=False`` per-stage deltas.

Reading these costs no host-device sync (allocator counters and tensor metadata only), so
the Session can sample them a few times a second without slowing the steps.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
from typing import Any

import torch

from workbench.core.records import MemoryUsage

__all__ = ["memory_report", "tensor_bytes", "host_rss", "StageMemoryTracker", "memory_at_save", "forecast_problem"]


def tensor_bytes(tensors: Any) -> int:
    """Bytes held by the distinct tensors in an iterable (shared storage counted once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        local = getattr(t, "_local_tensor", None)  # a DTensor (FSDP2): this rank's shard holds the bytes
        if isinstance(local, torch.Tensor):
            t = local
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
    out = []
    for state in inner.state.values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def host_rss() -> tuple[int, int]:
    """(current, peak) resident set size of this process in bytes."""
    current = 0
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
    return current, max(peak, current)


def memory_report(model: torch.nn.Module | None, optimizer: Any = None,
                  device: torch.device | None = None) -> MemoryUsage:
    """Exact bytes of the model's parameters, gradients and optimizer state, plus device/host use."""
    params = list(model.parameters()) if model is not None else []
    grads = [p.grad for p in params if p.grad is not None]
    device = device or (params[0].device if params else torch.device("cpu"))
    allocated = reserved = peak = None
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        peak = torch.cuda.max_memory_allocated(device)
    elif device.type == "mps":
        allocated = torch.mps.current_allocated_memory()
        reserved = torch.mps.driver_allocated_memory()
    rss, rss_peak = host_rss()
    return MemoryUsage(
        parameters=tensor_bytes(params),
        frozen_parameters=tensor_bytes(p for p in params if not p.requires_grad),
        gradients=tensor_bytes(grads),
        optimizer_state=tensor_bytes(_optimizer_tensors(optimizer)),
        device_type=device.type,
        device_allocated=allocated,
        device_reserved=reserved,
        device_peak=peak,
        host_rss=rss,
        host_peak=rss_peak,
    )


class StageMemoryTracker:
    """HF's memory metrics for a stage ("init", "train", "eval", "test"):
    ``{stage}_mem_cpu_alloc_delta``, ``{stage}_mem_cpu_peaked_delta`` and, on CUDA,
    ``{stage}_mem_gpu_alloc_delta`` / ``{stage}_mem_gpu_peaked_delta``.

    The host peak comes from a sampling thread (every ``interval`` seconds) while the
    stage runs, because the process-wide maximum RSS cannot be reset.
    """

    def __init__(self, device: torch.device, interval: float = 0.005) -> None:
        self.device = device
        self.interval = interval
        self._stage: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_rss = 0
        self._peak_rss = 0
        self._start_gpu = 0

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak_rss = max(self._peak_rss, host_rss()[0])

    def start(self, stage: str) -> None:
        """Begin measuring ``stage`` (nested starts are ignored: the outer stage counts)."""
        if self._stage is not None:
            return
        self._stage = stage
        self._start_rss = self._peak_rss = host_rss()[0]
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start_gpu = torch.cuda.memory_allocated(self.device)
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="workbench-memory", daemon=True)
        self._thread.start()

    def stop(self, stage: str) -> dict[str, int]:
        """End ``stage`` and return its metrics ({} if it was not the one being measured)."""
        if self._stage != stage:
            return {}
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        end = host_rss()[0]
        self._peak_rss = max(self._peak_rss, end)
        metrics = {
            f"{stage}_mem_cpu_alloc_delta": end - self._start_rss,
            f"{stage}_mem_cpu_peaked_delta": max(0, self._peak_rss - end),
        }
        if self.device.type == "cuda":
            now = torch.cuda.memory_allocated(self.device)
            metrics[f"{stage}_mem_gpu_alloc_delta"] = now - self._start_gpu
            metrics[f"{stage}_mem_gpu_peaked_delta"] = max(0, torch.cuda.max_memory_allocated(self.device) - now)
        self._stage = None
        return metrics


def memory_at_save(model: torch.nn.Module, optimizer: Any, device: torch.device, rows: int) -> dict[str, Any] | None:
    """What a checkpoint keeps of the device's memory for :func:`forecast_problem`: the peak
    so far, the model's own tensors (which a batch size does not change), the rows of a
    micro-batch and the device's total; None on devices without allocator counters."""
    if device.type != "cuda":
        return None
    report = memory_report(model, optimizer, device)
    return {"peak": report.device_peak, "static": report.parameters + report.gradients + report.optimizer_state,
            "rows": rows, "total": torch.cuda.get_device_properties(device).total_memory}


def forecast_problem(saved: dict[str, Any] | None, rows: int, total: int | None = None, margin: float = 0.95) -> str | None:
    """Why a micro-batch of ``rows`` would not fit, forecast from a save's figures: the model's
    tensors stay, the rest of the peak (activations) grows with the rows; None when it fits
    or nothing is known (the CPU). One line with the figures."""
    if not saved or not saved.get("peak") or not saved.get("rows") or rows <= saved["rows"]:
        return None
    total = total or saved.get("total")
    if not total:
        return None
    per_row = max(saved["peak"] - saved["static"], 0) / saved["rows"]
    forecast = saved["static"] + per_row * rows
    if forecast <= margin * total:
        return None
    gib = 2**30
    fits = int((margin * total - saved["static"]) / per_row) if per_row else rows
    return (f"a micro-batch of {rows} rows needs about {forecast / gib:.1f} GiB (measured: {saved['peak'] / gib:.1f} GiB "
            f"peak with {saved['rows']} rows, {saved['static'] / gib:.1f} GiB of it the model's tensors) of the "
            f"device's {total / gib:.1f} GiB; use at most {max(fits, 1)} rows (or gradient accumulation)")
