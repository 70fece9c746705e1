"""Fine-tune a sentence classifier on local csv files, then predict on a test file, written
the way transformers' example scripts are, with workbench's Trainer.

    python examples/hf_scripts/make_assets.py assets
    python examples/hf_scripts/run_classification.py --model_name_or_path assets/bert-cls \
        --train_file assets/cls/train.csv --validation_file assets/cls/validation.csv \
        --test_file assets/cls/test.csv --output_dir runs/cls --do_train --do_eval --do_predict

Batches come from ``DataCollatorWithPadding`` (``BatchEncoding`` objects, which are mappings
but not dicts). Changing the one import marked below gives transformers' own run.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import datasets
import numpy as np
import transformers
from datasets import load_dataset
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          EvalPrediction, HfArgumentParser, set_seed)
from transformers.trainer_utils import get_last_checkpoint

from workbench import Trainer, TrainingArguments  # the only line that differs from a transformers script

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "A local folder written by save_pretrained."})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "A csv with a text column and a label column."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "A csv to evaluate on."})
    test_file: Optional[str] = field(default=None, metadata={"help": "A csv to predict on."})
    text_column_name: str = field(default="sentence", metadata={"help": "The column holding the text."})
    label_column_name: str = field(default="label", metadata={"help": "The column holding the label."})
    max_seq_length: int = field(default=48, metadata={"help": "Truncate texts to this many tokens."})
    pad_to_max_length: bool = field(default=False, metadata={"help": "Pad every row to max_seq_length."})


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

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)

    set_seed(training_args.seed)

    files = {"train": data_args.train_file}
    for split, path in (("validation", data_args.validation_file), ("test", data_args.test_file)):
        if path:
            files[split] = path
    raw = load_dataset("csv", data_files=files)
    labels = sorted(set(raw["train"][data_args.label_column_name]))

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_args.model_name_or_path,
                                                               num_labels=len(labels))
    padding = "max_length" if data_args.pad_to_max_length else False

    def preprocess(examples):
        out = tokenizer(examples[data_args.text_column_name], padding=padding,
                        max_length=data_args.max_seq_length, truncation=True)
        out["label"] = [labels.index(value) for value in examples[data_args.label_column_name]]
        return out

    with training_args.main_process_first(desc="dataset map pre-processing"):
        processed = raw.map(preprocess, batched=True, remove_columns=raw["train"].column_names)

    def compute_metrics(p: EvalPrediction):
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        preds = np.argmax(preds, axis=1)
        return {"accuracy": float((preds == p.label_ids).astype(np.float32).mean())}

    collator = None if data_args.pad_to_max_length else DataCollatorWithPadding(tokenizer)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=processed["train"] if training_args.do_train else None,
        eval_dataset=processed["validation"] if training_args.do_eval else None,
        compute_metrics=compute_metrics,
        processing_class=tokenizer,
        data_collator=collator,
    )

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        metrics = train_result.metrics
        metrics["train_samples"] = len(processed["train"])
        trainer.save_model()
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate(eval_dataset=processed["validation"])
        metrics["eval_samples"] = len(processed["validation"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        test = processed["test"].remove_columns("label")
        predictions = trainer.predict(test, metric_key_prefix="predict").predictions
        predictions = np.argmax(predictions, axis=1)
        if trainer.is_world_process_zero():
            with open(os.path.join(training_args.output_dir, "predict_results.txt"), "w") as writer:
                writer.write("index\tprediction\n")
                for index, item in enumerate(predictions):
                    writer.write(f"{index}\t{labels[item]}\n")

    card = {"finetuned_from": model_args.model_name_or_path, "tasks": "text-classification"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**card)
    else:
        trainer.create_model_card(**card)


if __name__ == "__main__":
    main()
