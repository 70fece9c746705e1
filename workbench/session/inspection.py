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

from workbench.models.kinds import model_kind
from workbench.core.trainer_utils import unwrap_model
from workbench.door.commands import check_sample_options

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
    model = unwrap_model(trainer.model)
    causal = model_kind(model) == "ForCausalLM"  # GPT2LMHeadModel too (no loss_type, no "CausalLM" in its name)
    return hasattr(model, "generate") and causal and trainer.processing_class is not None


def sample_text(trainer: "Trainer", prompt: str, max_new_tokens: int = 64, temperature: float = 0.8,
                top_k: int | None = 20, seed: int = 0) -> str:
    """Generate a continuation of ``prompt`` with the model and the trainer's processing class
    (the options checked by check_sample_options first)."""
    check_sample_options(prompt, max_new_tokens, temperature, top_k, seed)
    model = unwrap_model(trainer.model)
    tokenizer = trainer.processing_class
    if tokenizer is None or not hasattr(model, "generate"):
        raise ValueError("sampling needs a causal LM with generate() and a processing_class (tokenizer)")
    encoded = tokenizer(prompt)
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded.input_ids
    ids = torch.as_tensor(ids, dtype=torch.long, device=trainer.accelerator.device)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.shape[1] == 0:
        raise ValueError("sample: the prompt gave no tokens; type some text the tokenizer knows")
    config = getattr(model, "config", None)
    context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and ids.shape[1] + max_new_tokens > context:
        raise ValueError(f"sample: the prompt's {ids.shape[1]} tokens plus max_new_tokens {max_new_tokens} exceed "
                         f"the model's context of {context} tokens; ask for at most {max(context - ids.shape[1], 0)}")
    was_training = model.training
    model.eval()
    try:
        generator = torch.Generator(device=ids.device).manual_seed(seed)
        try:
            out = model.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                 generator=generator)
        except (TypeError, ValueError):  # transformers' generate takes no generator (ValueError: unused model_kwargs)
            torch.manual_seed(seed)  # its sampling draws from the global RNG; Session.sample restores that
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                 temperature=temperature or 1.0, top_k=top_k)
    finally:
        model.train(was_training)
    new = out[0, ids.shape[1]:].tolist()
    return tokenizer.decode(new)
