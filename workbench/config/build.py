"""Assemble a Trainer from a validated RunConfig: model, datasets, hooks, arguments.

The config module only validates; this module does the work that may be slow (building
the model, loading data), so ``workbench run`` rejects a bad file before any of it.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from workbench.config.loader import RunConfig

__all__ = ["build_model", "build_datasets", "build_trainer"]


def _builtin_tokenizer(run: RunConfig) -> Any:
    """The tokenizer of the run's data: the builtin set's, or the one ``[data]`` tokenizes with."""
    if run.data.builtin is None:
        if run.data.tokenizer is None and run.data.text_column is None and run.data.format is None:
            return None
        from workbench.data.datasets_io import run_tokenizer

        return run_tokenizer(run)
    from workbench.data.builtin import builtin_tokenizer

    return builtin_tokenizer(run.data.builtin)


def build_model(run: RunConfig) -> Any:
    """The model named by ``[model]``; the builtin LM takes its vocabulary and context from the data."""
    spec = run.model
    options = dict(spec.options)
    if spec.builtin is not None:
        from workbench.models import BUILTIN_MODELS, build_builtin_model

        params = inspect.signature(BUILTIN_MODELS[spec.builtin]).parameters
        tokenizer = _builtin_tokenizer(run)
        if tokenizer is not None and "vocab_size" in params:
            options.setdefault("vocab_size", len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size)
        if "block_size" in params and "block_size" in run.data.options:
            options.setdefault("block_size", run.data.options["block_size"])
        if "block_size" in params and run.data.max_length:
            options.setdefault("block_size", run.data.max_length)
        return build_builtin_model(spec.builtin, **options)
    if spec.factory is not None:
        return spec.factory_fn(**options)
    model = _load_pretrained(spec.pretrained, options)
    if spec.peft is not None:
        from workbench.models.adapters import apply_lora

        model = apply_lora(model, spec.peft)
    return model


def _load_pretrained(path: str, options: dict[str, Any]) -> Any:
    try:
        import transformers
    except ImportError:
        raise RuntimeError(
            "model.pretrained needs the transformers package: pip install 'workbench[hf]'"
        ) from None
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    architectures = getattr(config, "architectures", None) or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    if cls is None:
        cls = transformers.AutoModel
    # The loading bar only on a terminal: in a log, a data problem found after the model is
    # loaded must be the one line on stderr (workbench run exits 2 with it).
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        return cls.from_pretrained(path, local_files_only=True, **options)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()


def build_datasets(run: RunConfig, *, progress: bool = True) -> tuple[Any, Any]:
    """(train, eval) datasets: a builtin set, or ``[data]`` loaded and prepared by
    :func:`workbench.data.datasets_io.load_run_data` (``progress``: datasets' progress bars)."""
    data = run.data
    if data.builtin is not None:
        from workbench.data.builtin import load_builtin_data

        return load_builtin_data(data.builtin, **data.options)
    from workbench.data.datasets_io import load_run_data

    loaded = load_run_data(run, progress=progress)
    return loaded.train, loaded.eval


def _default_collator(run: RunConfig, model: Any, tokenizer: Any) -> Any:
    """For tokenized ``[data]``: the collator the model's kind needs (HF scripts pick these by
    hand); None leaves the Trainer's default (padding, from the processing class)."""
    from workbench.data import collators

    if run.data.format is not None and tokenizer is not None:
        # Chat rows bring their own labels (-100 off the answers): pad them with -100, never
        # rebuild them from input_ids as the language-modeling collator would.
        return collators.DataCollatorForSeq2Seq(tokenizer)
    if run.data.text_column is None or tokenizer is None or model is None:
        return None
    import workbench.models.losses as losses

    kind = losses.model_kind(model)
    if kind == "ForCausalLM":
        return collators.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    if kind == "ForMaskedLM":
        seed = run.training.data_seed if run.training.data_seed is not None else run.training.seed
        return collators.DataCollatorForLanguageModeling(tokenizer, mlm=True, seed=seed)
    if kind == "ForTokenClassification":
        return collators.DataCollatorForTokenClassification(tokenizer)
    if kind in ("ForConditionalGeneration", "ForSeq2SeqLM"):
        return collators.DataCollatorForSeq2Seq(tokenizer, model=model)
    return None


def build_trainer(run: RunConfig, callbacks: list[Any] | None = None, *, progress: bool = True) -> Any:
    """A Trainer for ``run`` with its model, data, hooks and extra ``callbacks``.

    ``progress`` shows datasets' progress bars while loading and tokenizing (headless CLI).
    """
    from workbench.train.trainer import Trainer
    from workbench.core.trainer_utils import set_seed
    from workbench.train.one_run import check_free

    check_free("build a Trainer")  # before the model and data load, and before the seed changes a live run's RNG
    set_seed(run.training.seed)  # model init is part of what the seed reproduces
    hooks = dict(run.hooks)
    hook_callbacks = list(hooks.pop("callbacks", None) or [])
    model_init = hooks.pop("model_init", None)
    model = None if model_init is not None else build_model(run)
    train, evaluation = build_datasets(run, progress=progress)
    tokenizer = _builtin_tokenizer(run)
    if run.samples is not None:  # a model that cannot answer the prompts is one line now, not at the first eval
        from workbench.config.samples_table import check_can_sample

        hook_callbacks.append(check_can_sample(run.samples, model, tokenizer, run.training))
    if "data_collator" not in hooks:
        collator = _default_collator(run, model, tokenizer)
        if collator is not None:
            hooks["data_collator"] = collator
    return Trainer(
        model=model,
        model_init=model_init,
        args=run.training,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        callbacks=hook_callbacks + list(callbacks or []),
        guard=run.guard,
        health=run.health,
        **hooks,
    )
