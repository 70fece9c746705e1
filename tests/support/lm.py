"""The Session tests' language-model run: TinyGPT (one layer, 32 wide) on the standard
library's source, character-tokenized; the data is loaded once per process."""

from __future__ import annotations

from workbench import Trainer, TrainingArguments
from workbench.data.builtin import CharTokenizer, load_builtin_data
from workbench.models import TinyGPT

from support.runs import tiny_gpt

TOK = CharTokenizer()


_DATA: dict[tuple, tuple] = {}


def lm_data(max_chars: int = 20000, eval_fraction: float = 0.05):
    """(train, eval) blocks of 32 characters of the standard library's source."""
    key = ("lm", max_chars, eval_fraction)
    if key not in _DATA:
        _DATA[key] = load_builtin_data("python-source", block_size=32, max_chars=max_chars,
                                       eval_fraction=eval_fraction)
    return _DATA[key]


def mlp_data():
    """(train, eval) rows of the built-in random classification data (512 and 64)."""
    key = ("mlp",)
    if key not in _DATA:
        _DATA[key] = load_builtin_data("random-classification", n_train=512, n_eval=64)
    return _DATA[key]


def lm_model(seed: int = 0, dropout: float = 0.0) -> TinyGPT:
    """The run's TinyGPT: one layer, 32 wide, over the character vocabulary."""
    return tiny_gpt(seed, vocab_size=TOK.vocab_size, block_size=32, n_embd=32, dropout=dropout)


def lm_trainer(out, *, model=None, train=None, eval_dataset=None, callbacks=None, dropout=0.0,
               **overrides) -> Trainer:
    """A 40-step run of :func:`lm_model` on :func:`lm_data`, logging every 5 steps, saving nothing."""
    train_default, eval_default = lm_data()
    options = dict(output_dir=str(out), max_steps=40, per_device_train_batch_size=8,
                   per_device_eval_batch_size=16, learning_rate=3e-3, logging_steps=5,
                   save_strategy="no", report_to="none", disable_tqdm=True, seed=42)
    options.update(overrides)
    return Trainer(model=model if model is not None else lm_model(dropout=dropout),
                   args=TrainingArguments(**options),
                   train_dataset=train if train is not None else train_default,
                   eval_dataset=eval_dataset if eval_dataset is not None else eval_default,
                   processing_class=TOK, callbacks=callbacks)
