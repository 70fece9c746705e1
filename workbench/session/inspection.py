"""Looking inside a paused run: per-layer statistics and samples from a causal LM.

These read the model's tensors, so they host-sync freely; they are meant for a paused
run (or the end of one), never for the training hot path. Sampling runs only then (the
Session refuses it while the loop trains: it switches the model to eval mode and draws
from the RNG the loop uses), and it is capped at MAX_SAMPLE_TOKENS new tokens (door/commands.py), so a
sample holds a paused run for a bounded time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from workbench.core.trainer_utils import unwrap_model
from workbench.door.commands import check_sample_options
from workbench.train.generation import generate_text, generation_problem

if TYPE_CHECKING:  # for annotations only: the Trainer is a layer below, and heavy to import
    from workbench.train.trainer import Trainer


__all__ = ["inspect_model", "sample_text", "can_sample"]


def _optimizer_update(optimizer: Any, param: torch.nn.Parameter, lr: float) -> torch.Tensor | None:
    """The size of the step Adam-like optimizers take for ``param`` (from their moments)."""
    state = getattr(optimizer, "state", {}).get(param)
    if not state or "exp_avg" not in state or "exp_avg_sq" not in state:
        return None
    return lr * state["exp_avg"] / (state["exp_avg_sq"].sqrt() + 1e-8)


@torch.no_grad()
def inspect_model(trainer: "Trainer") -> dict[str, Any]:
    """A report for the inspect views: one row per parameter tensor, plus learning rates
    and the shapes of the last batch.

    Rows hold ``param_norm``, ``grad_norm`` (None after zero_grad), ``update_ratio`` (the
    optimizer's next step size relative to the weights; None for optimizers without
    moments), ``nan`` and ``inf`` counts.
    """
    model = unwrap_model(trainer.model)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    lrs = trainer.get_learning_rates() if trainer.optimizer is not None else []
    lr_of = {}
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                lr_of[p] = group["lr"]
    rows = []
    for name, p in model.named_parameters():
        data = p.detach().float()
        grad = p.grad.detach().float() if p.grad is not None else None
        update = _optimizer_update(optimizer, p, lr_of.get(p, 0.0)) if optimizer is not None else None
        pnorm = data.norm().item()
        rows.append({
            "name": name,
            "shape": tuple(p.shape),
            "param_norm": pnorm,
            "grad_norm": grad.norm().item() if grad is not None else None,
            "update_ratio": (update.float().norm().item() / pnorm) if update is not None and pnorm > 0 else None,
            "nan": int(torch.isnan(data).sum().item()) + (int(torch.isnan(grad).sum().item()) if grad is not None else 0),
            "inf": int(torch.isinf(data).sum().item()) + (int(torch.isinf(grad).sum().item()) if grad is not None else 0),
            "trainable": p.requires_grad,
        })
    batch = getattr(trainer, "last_inputs", None)
    shapes = {}
    if isinstance(batch, Mapping):  # a dict, or an HF collator's BatchEncoding (a UserDict)
        shapes = {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    return {"step": trainer.state.global_step, "layers": rows, "learning_rates": lrs, "batch_shapes": shapes}


def can_sample(trainer: "Trainer") -> bool:
    """Whether sample_text() can generate with this run: a causal LM with ``generate()`` and
    a processing class (tokenizer) to turn a prompt into ids and back."""
    return generation_problem(trainer.model, trainer.processing_class) is None


def sample_text(trainer: "Trainer", prompt: str, max_new_tokens: int = 64, temperature: float = 0.8,
                top_k: int | None = 20, seed: int = 0) -> str:
    """Generate a continuation of ``prompt`` with the model and the trainer's processing class
    (the options checked by check_sample_options first). The prompt is continued as typed
    (no chat template): the generation itself is the train layer's (train/generation.py),
    which the samples a run takes at its evaluations use too."""
    check_sample_options(prompt, max_new_tokens, temperature, top_k, seed)
    return generate_text(trainer.model, trainer.processing_class, prompt, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, seed=seed).answer
