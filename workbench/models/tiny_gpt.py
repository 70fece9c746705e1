"""TinyGPT: a small GPT-2-style causal language model in plain torch.

It exists so the workbench can train something real with no downloads: the demo, the tests
and the examples all use it. It follows the Hugging Face calling convention the Trainer
relies on (``forward(input_ids, attention_mask, labels, num_items_in_batch)`` returning a
dict whose first entry is the loss, ``gradient_checkpointing_enable``,
``get_input_embeddings``) without depending on transformers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from workbench.models.losses import causal_lm_loss

__all__ = ["TinyGPT"]


class _CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        # (B, T, C) -> (B, heads, T, head_dim), the layout SDPA expects.
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.attn_dropout if self.training else 0.0
        if attn_mask is None:
            # The fast path: SDPA can pick a fused kernel when it knows the mask is causal.
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return self.resid_dropout(self.proj(y))


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = _CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask)
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A pre-LayerNorm decoder-only transformer with learned positions and a tied LM head.

    Small enough to train on a laptop CPU in minutes, yet shaped like GPT-2 so the
    training features (gradient accumulation, checkpointing, NEFTune, weight-decay grouping)
    are exercised on a realistic module tree.
    """

    loss_type = "ForCausalLM"
    main_input_name = "input_ids"

    def __init__(
        self,
        vocab_size: int = 128,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 128,
        dropout: float = 0.0,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("n_layer", n_layer), ("n_head", n_head),
                            ("n_embd", n_embd), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.config: dict[str, Any] = {
            "vocab_size": vocab_size,
            "n_layer": n_layer,
            "n_head": n_head,
            "n_embd": n_embd,
            "block_size": block_size,
            "dropout": dropout,
            "tie_weights": tie_weights,
        }
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self._gradient_checkpointing = False
        self._checkpoint_kwargs: dict[str, Any] = {}
        self.apply(self._init_weights)
        # GPT-2 scales the residual output projections so the residual stream's variance
        # does not grow with depth.
        resid_std = 0.02 / math.sqrt(2 * n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp[2].weight, mean=0.0, std=resid_std)
        if tie_weights:
            # Tie after init so both names refer to the one (embedding-initialised) tensor.
            self.lm_head.weight = self.wte.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    # ------------------------------------------------------------------ HF-style hooks

    @property
    def supports_gradient_checkpointing(self) -> bool:
        """Always True: the Trainer checks this before enabling activation checkpointing."""
        return True

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether blocks recompute their activations in the backward pass (HF's name)."""
        return self._gradient_checkpointing

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each block's activations during backward to trade compute for memory.

        ``gradient_checkpointing_kwargs`` go to ``torch.utils.checkpoint.checkpoint``; the
        non-reentrant variant is the default because it works when no input requires grad.
        """
        self._checkpoint_kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        self._gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        """Store activations normally again (the default)."""
        self._gradient_checkpointing = False

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding; NEFTune hooks its output to add noise during training."""
        return self.wte

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Number of parameters, counting tied weights once; optionally only trainable ones, or
        without the embeddings (transformers' arguments: the Trainer's FLOP estimate uses it)."""
        skip = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)} if exclude_embeddings else set()
        return sum(p.numel() for p in self.parameters()
                   if (p.requires_grad or not only_trainable) and id(p) not in skip)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        """Logits for every position, plus the next-token loss when ``labels`` are given.

        ``labels`` are the unshifted ids (usually a copy of ``input_ids``, -100 where no loss
        is wanted); the shift happens in :func:`workbench.models.losses.causal_lm_loss`. With
        ``num_items_in_batch`` the loss is a sum divided by it, so gradient accumulation is
        exact. A zero in ``attention_mask`` hides that key from every query and positions
        count only attended tokens, so left- and right-padded batches give the same logits
        on real tokens as unpadded ones. Extra keyword arguments (as collators sometimes
        add) are ignored.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        seq = input_ids.size(1)
        if seq > self.block_size:
            raise ValueError(
                f"sequence length {seq} exceeds block_size {self.block_size}; "
                f"truncate or chunk the inputs to at most {self.block_size} tokens"
            )
        attn_mask = None
        positions = torch.arange(seq, device=input_ids.device).unsqueeze(0)
        # Without a mask SDPA takes its fused causal path. A given mask is always applied:
        # testing it for all-ones first (`if mask.all()`) would be a host-device sync on
        # every step, and padding collators hand one to every batch.
        if attention_mask is not None:
            keep = attention_mask.to(device=input_ids.device, dtype=torch.bool)
            positions = (keep.long().cumsum(-1) - 1).clamp(min=0)
            causal = torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device).tril()
            # Let every query see itself so fully padded rows stay finite instead of NaN.
            eye = torch.eye(seq, dtype=torch.bool, device=input_ids.device)
            attn_mask = (causal & (keep[:, None, None, :] | eye)).expand(-1, 1, -1, -1)

        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        use_checkpoint = self._gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if use_checkpoint:
                x = checkpoint(block, x, attn_mask, **self._checkpoint_kwargs)
            else:
                x = block(x, attn_mask)
        logits = self.lm_head(self.ln_f(x))

        if labels is None:
            return {"logits": logits}
        loss = causal_lm_loss(logits, labels, num_items_in_batch=num_items_in_batch)
        return {"loss": loss, "logits": logits}

    # ------------------------------------------------------------------ sampling

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend ``input_ids`` by ``max_new_tokens`` sampled tokens (prompt included).

        Used by the demo to show samples while training. The context is cropped to the last
        ``block_size`` tokens; ``temperature=0`` picks the argmax (deterministic), otherwise
        logits are divided by the temperature, optionally limited to the ``top_k`` best, and
        sampled with ``generator`` for reproducibility. The model runs in eval mode and its
        previous mode is restored afterwards. A 1-D prompt gives a 1-D result.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        squeeze = input_ids.dim() == 1
        ids = input_ids.unsqueeze(0) if squeeze else input_ids
        if ids.size(1) == 0:
            raise ValueError("generate needs a prompt of at least one token")
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits = self(ids[:, -self.block_size:])["logits"][:, -1, :].float()
                if temperature == 0:
                    next_id = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None and top_k < logits.size(-1):
                        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    probs = torch.softmax(logits, dim=-1)
                    next_id = torch.multinomial(probs, 1, generator=generator)
                ids = torch.cat([ids, next_id.to(ids.dtype)], dim=1)
        finally:
            self.train(was_training)
        return ids.squeeze(0) if squeeze else ids
