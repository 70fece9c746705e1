"""torch.compile end to end: the compiled model trains and the checkpoint holds the user's plain
weights (compiling on the CPU builds C++ kernels: about a minute).
"""

from __future__ import annotations

import torch

from workbench import Trainer, TrainingArguments


def test_torch_compile_trains_the_compiled_model_and_saves_plain_weights(tmp_path):
    # Compiling on the CPU builds C++ kernels with the system compiler: about a minute here.
    from workbench.data.builtin import load_builtin_data
    from workbench.models import MLPClassifier

    train, evals = load_builtin_data("random-classification", n_train=256)
    torch.manual_seed(0)
    args = TrainingArguments(str(tmp_path), max_steps=10, torch_compile=True, disable_tqdm=True,
                             save_strategy="steps", save_steps=10, logging_steps=5, report_to="none")
    trainer = Trainer(MLPClassifier(), args=args, train_dataset=train, eval_dataset=evals)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    assert trainer.evaluate()["eval_loss"] < before
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "checkpoint-10" / "model.safetensors"))
    assert not any(k.startswith("_orig_mod") for k in saved)  # the user's module, not the wrapper
