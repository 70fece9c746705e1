"""Model and optimizer state in and out of a prepared model: plain, DDP or FSDP.

Saving takes *host copies* (nothing that training mutates afterwards is referenced), so
the files can be written while training goes on. Under FSDP the full state is gathered
with torch's distributed state-dict API (a collective: every rank calls it; rank 0 gets
the tensors) and optimizer state is keyed by parameter name, the format
``set_optimizer_state_dict`` loads into FSDP and plain models alike. Loading accepts
either format, so checkpoints move between 1 process, DDP and FSDP runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from workbench.core.run import Run
from workbench.core.trainer_utils import unwrap_model
from workbench.models.adapters import adapter_state, is_peft_model


__all__ = ["host_copy", "nested_nbytes", "unique_state", "capture_model_state", "capture_optimizer_state",
           "load_model_state", "load_optimizer_state", "is_fsdp"]



def is_fsdp(run: Run) -> bool:
    """Whether the model is sharded by FSDP (its state must be gathered and scattered)."""
    from accelerate.utils import DistributedType

    return run.accelerator.distributed_type == DistributedType.FSDP


def host_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to host memory (containers rebuilt, other values kept)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [host_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(host_copy(v) for v in obj)
    return obj


def nested_nbytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (dicts, lists and tuples of them, as state dicts and
    gathered outputs nest them; each tensor's own elements, other values count nothing)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(nested_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nested_nbytes(v) for v in obj)
    return 0


def unique_state(model: torch.nn.Module, copy: bool = False) -> dict[str, torch.Tensor]:
    """The state dict without aliases (tied weights stored once, under their first name)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().to("cpu", copy=copy).contiguous()
    return out


def _options(**kwargs: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds the real one


def capture_model_state(run: Run) -> dict[str, torch.Tensor] | None:
    """Host copies of the full weights on rank 0 (None on other ranks); collective under FSDP.

    Of a PEFT model only the trainable (adapter) tensors: the frozen base never changes, and
    its checkpoint holds the adapter alone, as transformers' Trainer writes it.
    """
    model = unwrap_model(run.model)
    if is_fsdp(run):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(run.model_wrapped, options=_options(cpu_offload=True))
        if is_peft_model(model):
            trainable = {name for name, p in model.named_parameters() if p.requires_grad}
            state = {name: t for name, t in state.items() if name in trainable}
        return state if run.accelerator.is_main_process else None
    if not run.accelerator.is_main_process:
        return None
    return adapter_state(model) if is_peft_model(model) else unique_state(model, copy=True)


def capture_optimizer_state(run: Run) -> dict[str, Any] | None:
    """A host copy of the optimizer state on rank 0 (None elsewhere); collective under FSDP."""
    optimizer = _torch_optimizer(run.optimizer)
    if is_fsdp(run):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = get_optimizer_state_dict(run.model_wrapped, optimizer, options=_options(cpu_offload=True))
        return state if run.accelerator.is_main_process else None
    if not run.accelerator.is_main_process:
        return None
    return host_copy(optimizer.state_dict())


def load_model_state(run: Run, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load full weights (every rank passes them); returns (missing, unexpected) names."""
    model = unwrap_model(run.model)
    if is_fsdp(run):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        result = set_model_state_dict(run.model_wrapped, state, options=_options(strict=False))
        return list(result.missing_keys), list(result.unexpected_keys)
    missing, unexpected = model.load_state_dict(state, strict=False)
    return list(missing), list(unexpected)


def _keyed_by_name(state: dict[str, Any]) -> bool:
    return any(isinstance(p, str) for group in state.get("param_groups", []) for p in group.get("params", []))


def load_optimizer_state(run: Run, state: dict[str, Any]) -> None:
    """Load optimizer state saved by any run: index-keyed (torch) or name-keyed (FSDP)."""
    optimizer = _torch_optimizer(run.optimizer)
    state = regroup(state, optimizer.param_groups)
    if not is_fsdp(run) and not _keyed_by_name(state):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not _keyed_by_name(state):
        state = _index_to_names(run, optimizer, state)
    set_optimizer_state_dict(run.model_wrapped if is_fsdp(run) else unwrap_model(run.model),
                             optimizer, state, options=_options())


def _index_to_names(run: Run, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """torch's index-keyed optimizer state -> parameter-name keys, by this optimizer's order."""
    names = {id(p): n for n, p in unwrap_model(run.model).named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {
        "state": {order[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def regroup(state: dict[str, Any], current: list[dict[str, Any]]) -> dict[str, Any]:
    """Optimizer state re-cut into the ``current`` optimizer's groups (same parameter order).

    Runs with and without weight decay group the same parameters as two groups or one
    (models/param_groups.py); a checkpoint of either layout resumes in the other. Each new
    group keeps the hyperparameters of the saved group its first parameter came from,
    except weight_decay, which the optimizer being loaded into decides.
    """
    groups = state.get("param_groups", [])
    sizes = [len(g["params"]) for g in current]
    if sum(len(g["params"]) for g in groups) != sum(sizes):
        return state  # not convertible: torch reports the mismatch
    if [len(g["params"]) for g in groups] == sizes:  # same layout: only the decay is this run's
        out = [{**g, "weight_decay": c.get("weight_decay", g.get("weight_decay"))} for g, c in zip(groups, current)]
        return {**state, "param_groups": out}
    flat = [(p, g) for g in groups for p in g["params"]]
    out, start = [], 0
    for size, group in zip(sizes, current):
        params = [p for p, _ in flat[start:start + size]]
        source = flat[start][1] if size else groups[0]
        out.append({**{k: v for k, v in source.items() if k != "params"},
                    "weight_decay": group.get("weight_decay", source.get("weight_decay")), "params": params})
        start += size
    return {**state, "param_groups": out}
