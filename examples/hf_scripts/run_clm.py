"""Fine-tune a causal language model on local text files, written the way transformers'
example scripts are (HfArgumentParser over three dataclasses, ``datasets`` text files, a
model and tokenizer from a local folder), with workbench's Trainer.

    python examples/hf_scripts/make_assets.py assets
    python examples/hf_scripts/run_clm.py --model_name_or_path assets/gpt2 \
        --train_file assets/text/train.txt --validation_file assets/text/validation.txt \
        --output_dir runs/clm --do_train --do_eval --max_steps 40

Changing the one import marked below to ``from transformers import Trainer,
TrainingArguments`` gives transformers' own run; the tests run both and compare them.
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
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, default_data_collator, set_seed
from transformers.trainer_utils import get_last_checkpoint

from workbench import Trainer, TrainingArguments  # the only line that differs from a transformers script

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "A local folder written by save_pretrained."})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "Tokenizer folder, if not the model's."})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "A text file, one line per example."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Text file to evaluate on."})
    block_size: int = field(default=32, metadata={"help": "Tokens per training sequence after grouping."})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Truncate the training set."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Truncate the evaluation set."})


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        datefmt="%m/%d/%Y %H:%M:%S", handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.warning(
        f"Process rank: {training_args.process_index}, device: {training_args.device}, "
        f"n_gpu: {training_args.n_gpu}, distributed: {training_args.parallel_mode.value == 'distributed'}, "
        f"16-bits training: {training_args.fp16}"
    )

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint detected, resuming training at {last_checkpoint}.")

    set_seed(training_args.seed)

    files = {"train": data_args.train_file}
    if data_args.validation_file:
        files["validation"] = data_args.validation_file
    raw = load_dataset("text", data_files=files)

    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)

    def tokenize(examples):
        return tokenizer(examples["text"])

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=["text"], desc="Running tokenizer on dataset")

    block_size = data_args.block_size

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = (len(joined["input_ids"]) // block_size) * block_size
        result = {k: [t[i: i + block_size] for i in range(0, total, block_size)] for k, t in joined.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        lm_datasets = tokenized.map(group_texts, batched=True, desc=f"Grouping texts in chunks of {block_size}")

    train_dataset = eval_dataset = None
    if training_args.do_train:
        train_dataset = lm_datasets["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))
    if training_args.do_eval:
        eval_dataset = lm_datasets["validation"]
        if data_args.max_eval_samples is not None:
            eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))

    def preprocess_logits_for_metrics(logits, labels):
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        # Predictions at position i are for the token at i + 1.
        labels = labels[:, 1:].reshape(-1)
        preds = preds[:, :-1].reshape(-1)
        keep = labels != -100
        return {"accuracy": float(np.mean(preds[keep] == labels[keep]))}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
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
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    card = {"finetuned_from": model_args.model_name_or_path, "tasks": "text-generation"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**card)
    else:
        trainer.create_model_card(**card)


if __name__ == "__main__":
    main()
