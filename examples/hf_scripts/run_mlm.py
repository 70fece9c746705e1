"""Fine-tune a masked language model on local text files with random masking, written the
way transformers' example scripts are, with workbench's Trainer.

    python examples/hf_scripts/make_assets.py assets
    python examples/hf_scripts/run_mlm.py --model_name_or_path assets/bert-mlm \
        --train_file assets/text/train.txt --validation_file assets/text/validation.txt \
        --output_dir runs/mlm --do_train --do_eval --max_steps 40

The masking is drawn by ``DataCollatorForLanguageModeling`` from the global torch generator,
so a seeded run masks the same tokens as transformers' Trainer does. Changing the one import
marked below gives transformers' own run.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain
from typing import Optional

import datasets
import numpy as np
import transformers
from datasets import load_dataset
from transformers import (AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling, HfArgumentParser,
                          set_seed)
from transformers.trainer_utils import get_last_checkpoint

from workbench import Trainer, TrainingArguments  # the only line that differs from a transformers script

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "A local folder written by save_pretrained."})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "A text file, one line per example."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Text file to evaluate on."})
    max_seq_length: int = field(default=32, metadata={"help": "Tokens per sequence after grouping."})
    mlm_probability: float = field(default=0.15, metadata={"help": "Share of tokens to mask."})
    line_by_line: bool = field(default=False, metadata={"help": "One example per line instead of grouping."})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Truncate the training set."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Truncate the evaluation set."})


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.info(f"Training/evaluation parameters {training_args}")

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)

    set_seed(training_args.seed)

    files = {"train": data_args.train_file}
    if data_args.validation_file:
        files["validation"] = data_args.validation_file
    raw = load_dataset("text", data_files=files)

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForMaskedLM.from_pretrained(model_args.model_name_or_path)
    max_seq_length = min(data_args.max_seq_length, tokenizer.model_max_length)

    if data_args.line_by_line:
        def tokenize(examples):
            lines = [line for line in examples["text"] if line and not line.isspace()]
            return tokenizer(lines, truncation=True, max_length=max_seq_length, return_special_tokens_mask=True)

        with training_args.main_process_first(desc="dataset map tokenization"):
            tokenized = raw.map(tokenize, batched=True, remove_columns=["text"])
    else:
        def tokenize(examples):
            return tokenizer(examples["text"], return_special_tokens_mask=True)

        def group_texts(examples):
            joined = {k: list(chain(*examples[k])) for k in examples}
            total = (len(joined[next(iter(examples))]) // max_seq_length) * max_seq_length
            return {k: [t[i: i + max_seq_length] for i in range(0, total, max_seq_length)] for k, t in joined.items()}

        with training_args.main_process_first(desc="dataset map tokenization"):
            tokenized = raw.map(tokenize, batched=True, remove_columns=["text"])
        with training_args.main_process_first(desc="grouping texts together"):
            tokenized = tokenized.map(group_texts, batched=True)

    train_dataset = eval_dataset = None
    if training_args.do_train:
        train_dataset = tokenized["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))
    if training_args.do_eval:
        eval_dataset = tokenized["validation"]
        if data_args.max_eval_samples is not None:
            eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))

    def preprocess_logits_for_metrics(logits, labels):
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        keep = labels != -100
        return {"accuracy": float(np.mean(preds[keep] == labels[keep]))}

    collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=data_args.mlm_probability)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
    )

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    card = {"finetuned_from": model_args.model_name_or_path, "tasks": "fill-mask"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**card)
    else:
        trainer.create_model_card(**card)


if __name__ == "__main__":
    main()
