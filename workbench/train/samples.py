"""Samples as a run trains: answers to fixed prompts at each evaluation (or every N steps).

What the user asks for is :class:`Samples` (the ``[samples]`` table; checked once, when it is
made); :class:`SamplesCallback` takes them (``Trainer(callbacks=[SamplesCallback(prompts=[...])])``
in Python, or the config's table). At each sample point rank 0 generates one answer per
prompt (train/generation.py: eval mode, every random stream preserved, so the run trains
bitwise as without samples) and tells the other callbacks through ``on_sample``: the event
log writes one ``sample`` record per prompt to events.jsonl, a Session publishes them to
its front-ends. Between sample points the callback costs nothing: with ``every = "eval"``
it has no per-step hook at all.
"""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass, fields
from typing import Any

from workbench.core.args.training import ArgumentError
from workbench.core.callbacks import TrainerCallback
from workbench.core.trainer_utils import unwrap_model

log = logging.getLogger("workbench")

__all__ = ["MAX_NEW_TOKENS", "MAX_PROMPTS", "SAMPLES_FIELDS", "Samples", "SamplesCallback"]

# New tokens one answer may ask for (as door/commands.py's MAX_SAMPLE_TOKENS): a sample point
# holds the run, so its length is bounded.
MAX_NEW_TOKENS = 1024
# Prompts a run may sample: each one is generated at every sample point.
MAX_PROMPTS = 64
_MAX_TEMPERATURE = 100.0
# Samples a callback keeps in ``history`` (the events.jsonl records keep all of them).
HISTORY = 10_000


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _whole(value: Any, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


@dataclass(frozen=True)
class Samples:
    """What to sample while training.

    ``prompts``: the texts to answer (1 to MAX_PROMPTS, each non-empty, no two alike);
    ``max_new_tokens``: tokens per answer (1 to MAX_NEW_TOKENS); ``every``: "eval" (at each
    evaluation, the default) or a number of steps; ``temperature``: 0 for greedy decoding
    (the default: the same weights give the same answer), else sampled from ``seed`` with
    ``top_k``; ``chat``: each prompt as a user message of the tokenizer's chat template (True),
    the raw prompt text (False), or None: the template when the tokenizer has one.
    """

    prompts: tuple[str, ...]
    max_new_tokens: int = 32
    every: int | str = "eval"
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0
    chat: bool | None = None

    def __post_init__(self) -> None:
        # ArgumentError names the field: the config loader turns it into "file:line: samples.KEY: reason".
        given = self.prompts
        prompts = tuple(given) if isinstance(given, (list, tuple)) else None
        if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
            raise ArgumentError("prompts", f"expected a list of 1 to {MAX_PROMPTS} non-empty texts, "
                                           f"got {_shown(given)}")
        object.__setattr__(self, "prompts", prompts)
        if len(prompts) > MAX_PROMPTS:
            raise ArgumentError("prompts", f"at most {MAX_PROMPTS} prompts (each is answered at every sample "
                                           f"point), got {len(prompts)}")
        twice = next((p for i, p in enumerate(prompts) if p in prompts[:i]), None)
        if twice is not None:
            raise ArgumentError("prompts", f"{_shown(twice)} is given twice")
        if not _whole(self.max_new_tokens, 1) or self.max_new_tokens > MAX_NEW_TOKENS:
            raise ArgumentError("max_new_tokens", f"expected a whole number from 1 to {MAX_NEW_TOKENS}, "
                                                  f"got {_shown(self.max_new_tokens)}")
        if self.every != "eval" and not _whole(self.every, 1):
            raise ArgumentError("every", f'expected "eval" (at each evaluation) or a whole number of steps >= 1, '
                                         f"got {_shown(self.every)}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                or not 0 <= t <= _MAX_TEMPERATURE:
            raise ArgumentError("temperature", f"expected a number from 0 (greedy) to {_MAX_TEMPERATURE:g}, "
                                               f"got {_shown(t)}")
        object.__setattr__(self, "temperature", float(t))
        if self.top_k is not None and not _whole(self.top_k, 1):
            raise ArgumentError("top_k", f"expected a whole number >= 1 (or no top_k: no limit), got {_shown(self.top_k)}")
        if not _whole(self.seed, 0) or self.seed >= 2**63:
            raise ArgumentError("seed", f"expected a whole number >= 0, got {_shown(self.seed)}")
        if self.chat is not None and not isinstance(self.chat, bool):
            raise ArgumentError("chat", f"expected true or false (or no chat: the template when the tokenizer "
                                        f"has one), got {_shown(self.chat)}")


SAMPLES_FIELDS = tuple(f.name for f in fields(Samples))


class SamplesCallback(TrainerCallback):
    """Generate answers to ``prompts`` at each evaluation (``every="eval"``) or every N steps.

    Takes :class:`Samples`' fields as keywords. Each sample point's answers go to the other
    callbacks' ``on_sample`` (events.jsonl, a Session's front-ends) and into ``history``
    (``{"step", "prompt", "answer", "tokens"}``, the newest HISTORY). A run whose model
    cannot generate (not a causal LM, no tokenizer) fails when it starts, with one line.
    """

    def __init__(self, prompts: list[str] | tuple[str, ...], max_new_tokens: int = 32, every: int | str = "eval",
                 temperature: float = 0.0, top_k: int | None = None, seed: int = 0,
                 chat: bool | None = None) -> None:
        self.settings = Samples(prompts=prompts, max_new_tokens=max_new_tokens, every=every,
                                temperature=temperature, top_k=top_k, seed=seed, chat=chat)
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self._sampled_at: int | None = None
        # The handler calls only the hooks a callback overrides: the one this callback does not
        # use is put back to the base class's no-op, so no step pays for a check.
        if self.settings.every == "eval":
            self.on_step_end = TrainerCallback.on_step_end.__get__(self)  # type: ignore[method-assign]
        else:
            self.on_evaluate = TrainerCallback.on_evaluate.__get__(self)  # type: ignore[method-assign]

    @classmethod
    def from_settings(cls, settings: Samples) -> SamplesCallback:
        """The callback of a checked :class:`Samples` (the config's ``[samples]`` table)."""
        return cls(**{name: getattr(settings, name) for name in SAMPLES_FIELDS})

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        # Checked on every rank alike, so a run that cannot sample fails everywhere at once.
        self._sampled_at = None
        problem = self.problem(model, processing_class, args)
        if problem is not None:
            raise ValueError(f"samples: {problem}")
        if self.settings.every == "eval" and args.eval_strategy == "no" and not args.eval_on_start:
            log.warning('samples: every = "eval" but eval_strategy is "no": answers come only with evaluations '
                        "asked for (the dashboard's e key, session.evaluate())")

    def problem(self, model: Any, tokenizer: Any, args: Any = None) -> str | None:
        """Why this run cannot take these samples (one line), or None: a model that cannot
        generate, a chat template asked for and missing, a prompt too long for the model's
        context, weights sharded across processes."""
        from workbench.train.generation import encode_prompt, generation_problem, uses_chat_template

        problem = generation_problem(model, tokenizer)
        if problem is not None:
            return problem
        settings = self.settings
        if settings.chat and not getattr(tokenizer, "chat_template", None):
            return "chat = true, but the tokenizer has no chat_template; set chat = false to send the raw prompt"
        if _sharded(args):
            return ("rank 0 generates alone, and FSDP or DeepSpeed ZeRO-3 shards the weights across processes; "
                    "use DDP, or leave samples out")
        chat = uses_chat_template(tokenizer, settings.chat)
        config = getattr(unwrap_model(model), "config", None)
        context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
        for prompt in settings.prompts:
            ids = encode_prompt(tokenizer, prompt, chat)
            if not ids:
                return f"the prompt {_shown(prompt)} gives no tokens"
            if isinstance(context, int) and len(ids) + settings.max_new_tokens > context:
                return (f"the prompt {_shown(prompt)} has {len(ids)} tokens; with max_new_tokens "
                        f"{settings.max_new_tokens} that exceeds the model's context of {context} tokens")
        return None

    def on_evaluate(self, args, state, control, model=None, processing_class=None, callback_handler=None,
                    **kwargs):
        self._sample(args, state, control, model, processing_class, callback_handler)

    def on_step_end(self, args, state, control, model=None, processing_class=None, callback_handler=None,
                    **kwargs):
        if state.global_step % self.settings.every == 0:
            self._sample(args, state, control, model, processing_class, callback_handler)

    def _sample(self, args, state, control, model, tokenizer, handler) -> None:
        """One sample point: rank 0 answers every prompt (generation is local: no collective,
        so the other ranks only wait at their next one) and tells the other callbacks."""
        step = state.global_step
        if not state.is_world_process_zero or step == self._sampled_at:
            return  # one sample point a step: an evaluation asked for on a paused run has the same weights
        self._sampled_at = step
        from workbench.train.generation import generate_text, uses_chat_template

        settings = self.settings
        chat = uses_chat_template(tokenizer, settings.chat)
        samples = []
        for prompt in settings.prompts:
            try:
                out = generate_text(model, tokenizer, prompt, max_new_tokens=settings.max_new_tokens,
                                    temperature=settings.temperature, top_k=settings.top_k, seed=settings.seed,
                                    chat=chat)
            except Exception as exc:  # noqa: BLE001 - a sample must never end the run it watches
                log.warning("samples: step %d: the prompt %s failed (%s: %s); the run goes on", step,
                            _shown(prompt), type(exc).__name__, exc)
                continue
            samples.append({"prompt": prompt, "answer": out.answer, "tokens": out.tokens})
        self.history.extend({"step": step, **s} for s in samples)
        if samples and handler is not None:
            handler.on_sample(args, state, control, samples)


def _sharded(args: Any) -> bool:
    """Whether the run's weights are sharded across processes (FSDP, DeepSpeed ZeRO-3)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if not AcceleratorState._shared_state:  # no Accelerator made (a plain call): nothing is sharded
        return bool(getattr(args, "fsdp", None))
    accelerator_state = AcceleratorState()
    if accelerator_state.distributed_type == DistributedType.FSDP:
        return True
    plugin = getattr(accelerator_state, "deepspeed_plugin", None)
    return accelerator_state.distributed_type == DistributedType.DEEPSPEED and getattr(plugin, "zero_stage", 0) == 3
