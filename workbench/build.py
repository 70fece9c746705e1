"""Assemble a Trainer from a validated RunConfig: model, datasets, hooks, arguments.

The config module only validates; this module does the work that may be slow (building
the model, loading data), so ``workbench run`` rejects a bad file before any of it.
"""

from __future__ import annotations

import inspect
from typing import Any

from .config import RunConfig

__all__ = ["build_model", "build_datasets", "build_trainer"]


def _builtin_tokenizer(run: RunConfig) -> Any:
    if run.data.builtin is None:
        return None
    from .data import builtin_tokenizer

    return builtin_tokenizer(run.data.builtin)


def build_model(run: RunConfig) -> Any:
    """The model named by ``[model]``; the builtin LM takes its vocabulary and context from the data."""
    spec = run.model
    options = dict(spec.options)
    if spec.builtin is not None:
        from .models import BUILTIN_MODELS, build_builtin_model

        params = inspect.signature(BUILTIN_MODELS[spec.builtin]).parameters
        tokenizer = _builtin_tokenizer(run)
        if tokenizer is not None and "vocab_size" in params:
            options.setdefault("vocab_size", tokenizer.vocab_size)
        if "block_size" in params and "block_size" in run.data.options:
            options.setdefault("block_size", run.data.options["block_size"])
        return build_builtin_model(spec.builtin, **options)
    if spec.factory is not None:
        return spec.factory_fn(**options)
    return _load_pretrained(spec.pretrained, options)


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
    return cls.from_pretrained(path, local_files_only=True, **options)


def build_datasets(run: RunConfig) -> tuple[Any, Any]:
    """(train, eval) datasets: a builtin set, or ``datasets.load_dataset`` results."""
    data = run.data
    if data.builtin is not None:
        from .data import load_builtin_data

        return load_builtin_data(data.builtin, **data.options)
    import datasets

    def load(kwargs: dict[str, Any]) -> Any:
        kwargs = dict(kwargs)
        kwargs.setdefault("split", "train")
        return datasets.load_dataset(**kwargs)

    train = load(data.train) if data.train else None
    evaluation = None
    if data.eval:
        named = all(isinstance(v, dict) for v in data.eval.values())
        evaluation = {name: load(t) for name, t in data.eval.items()} if named else load(data.eval)
    return train, evaluation


def build_trainer(run: RunConfig, callbacks: list[Any] | None = None) -> Any:
    """A Trainer for ``run`` with its model, data, hooks and extra ``callbacks``."""
    from .trainer import Trainer
    from .trainer_utils import set_seed

    set_seed(run.training.seed)  # model init is part of what the seed reproduces
    hooks = dict(run.hooks)
    hook_callbacks = list(hooks.pop("callbacks", None) or [])
    model_init = hooks.pop("model_init", None)
    model = None if model_init is not None else build_model(run)
    train, evaluation = build_datasets(run)
    return Trainer(
        model=model,
        model_init=model_init,
        args=run.training,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=_builtin_tokenizer(run),
        callbacks=hook_callbacks + list(callbacks or []),
        **hooks,
    )
