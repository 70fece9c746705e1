"""The training core: TrainingArguments, the Trainer and its HF override points, the loop,
evaluation, callbacks, optimizers, losses, and the live edits applied between steps.
"""
