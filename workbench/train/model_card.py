"""An offline model card (README.md) for a trained model: what ``Trainer.create_model_card``
writes, with the sections and metadata keys of the cards transformers' Trainer writes (so the
Hub and the tools that read those cards find what they look for), built from what the
Trainer knows: its arguments, the log history, the model class and the installed packages.

Nothing here reaches the network (transformers asks the Hub for the base model's license;
workbench leaves the license to the caller) and nothing imports transformers.
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any
from workbench.core.run import Run

__all__ = ["model_card", "hyperparameters", "results_from_history"]


# Tasks by the ending of the model's class name (transformers' auto-model families).
TASKS = {
    "ForCausalLM": "text-generation",
    "LMHeadModel": "text-generation",
    "ForMaskedLM": "fill-mask",
    "ForSequenceClassification": "text-classification",
    "ForTokenClassification": "token-classification",
    "ForQuestionAnswering": "question-answering",
    "ForConditionalGeneration": "text2text-generation",
    "ForImageClassification": "image-classification",
}
TASK_TITLES = {
    "text-generation": "Causal Language Modeling",
    "fill-mask": "Masked Language Modeling",
    "text-classification": "Text Classification",
    "token-classification": "Token Classification",
    "question-answering": "Question Answering",
    "image-classification": "Image Classification",
}
# Metric names the Hub knows as metric types.
METRIC_TYPES = ("accuracy", "bleu", "f1", "matthews_correlation", "pearsonr", "precision", "recall", "rouge",
                "sacrebleu", "spearmanr", "wer")
# Dataset builders that stand for local files, not for a named dataset.
LOCAL_BUILDERS = ("csv", "json", "pandas", "parquet", "text", "arrow")
TAG = "generated_from_trainer"
DROPPED = ("runtime", "samples_per_second", "steps_per_second", "epoch", "step", "total_flos")


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _title(key: str) -> str:
    return " ".join(part.capitalize() for part in key.split("_"))


def _shown(value: Any) -> str:
    """A number as the card shows it: at most four decimals."""
    text = str(value)
    if isinstance(value, float) and "." in text and len(text.split(".")[1]) > 4:
        return f"{value:.4f}"
    return text


def results_from_history(log_history: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The training-results table (one row per evaluation before the end of training: the
    last training loss logged, epoch, step, validation loss, the other metrics) and the final
    evaluation's results, from a Trainer's ``log_history``."""
    end = next((i for i, e in enumerate(log_history) if "train_runtime" in e), None)
    rows: list[dict[str, Any]] = []
    train_loss: Any = "No log"
    for entry in log_history[:end] if end is not None else []:
        if "loss" in entry:
            train_loss = entry["loss"]
        if "eval_loss" in entry:
            row = {"Training Loss": train_loss, "Epoch": entry.get("epoch"), "Step": entry.get("step"),
                   "Validation Loss": entry["eval_loss"]}
            for key, value in entry.items():
                if key.startswith("eval_") and key != "eval_loss" and not key.endswith(DROPPED):
                    row[_title(key.removeprefix("eval_"))] = value
            rows.append(row)
    last = next((e for e in reversed(log_history) if "eval_loss" in e), None)
    if last is None:
        return rows, None
    final = {_title(k.removeprefix("eval_")): v for k, v in last.items() if k.removeprefix("eval_") not in DROPPED}
    return rows, final


def hyperparameters(trainer: Run) -> dict[str, Any]:
    """The arguments a card lists, under the names transformers' cards use."""
    args = trainer.args
    world = trainer.accelerator.num_processes
    out: dict[str, Any] = {"learning_rate": args.learning_rate, "train_batch_size": args.train_batch_size,
                           "eval_batch_size": args.eval_batch_size, "seed": args.seed}
    if world > 1:
        out["distributed_type"] = "multi-GPU" if trainer.accelerator.device.type == "cuda" else "multi-process"
        out["num_devices"] = world
    if args.gradient_accumulation_steps > 1:
        out["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    total_train = args.train_batch_size * world * args.gradient_accumulation_steps
    if total_train != args.train_batch_size:
        out["total_train_batch_size"] = total_train
    if args.eval_batch_size * world != args.eval_batch_size:
        out["total_eval_batch_size"] = args.eval_batch_size * world
    optim = str(getattr(args.optim, "value", args.optim))
    extra = args.optim_args or "No additional optimizer arguments"
    if "adam" in optim.lower():
        out["optimizer"] = (f"Use {optim} with betas=({args.adam_beta1},{args.adam_beta2}) and "
                            f"epsilon={args.adam_epsilon} and optimizer_args={extra}")
    else:
        out["optimizer"] = f"Use {optim} and the args are:\n{extra}"
    out["lr_scheduler_type"] = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if args.warmup_steps:
        out["lr_scheduler_warmup_steps"] = args.warmup_steps
    if args.max_steps > 0:
        out["training_steps"] = args.max_steps
    else:
        out["num_epochs"] = args.num_train_epochs
    if args.fp16:
        out["mixed_precision_training"] = "Native AMP"
    if args.label_smoothing_factor:
        out["label_smoothing_factor"] = args.label_smoothing_factor
    return out


def _framework_versions() -> list[str]:
    """The installed versions of the packages the run used (read from their metadata, so
    nothing is imported for it)."""
    lines = []
    for label, package in (("workbench", "workbench"), ("Transformers", "transformers"), ("Pytorch", "torch"),
                           ("Accelerate", "accelerate"), ("Datasets", "datasets"), ("Tokenizers", "tokenizers")):
        try:
            lines.append(f"- {label} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            continue
    return lines


def _yaml(metadata_: dict[str, Any]) -> str:
    """The card's front matter. JSON scalars are YAML scalars, so values are written with
    json.dumps (quoted where needed) and no YAML library is required."""
    lines = []

    def scalar(value: Any) -> str:
        return json.dumps(value)

    for key, value in metadata_.items():
        if key == "model-index":
            lines.append("model-index:")
            for model in value:
                lines.append(f"- name: {scalar(model['name'])}")
                if not model["results"]:
                    lines.append("  results: []")
                    continue
                lines.append("  results:")
                for result in model["results"]:
                    lines.append(f"  - task:\n      name: {scalar(result['task']['name'])}\n"
                                 f"      type: {scalar(result['task']['type'])}")
                    lines.append("    dataset:")
                    lines.extend(f"      {k}: {scalar(v)}" for k, v in result["dataset"].items())
                    lines.append("    metrics:")
                    for metric in result["metrics"]:
                        lines.append(f"    - name: {scalar(metric['name'])}\n      type: {scalar(metric['type'])}\n"
                                     f"      value: {scalar(metric['value'])}")
        elif isinstance(value, list):
            lines.append(f"{key}:")
            lines.extend(f"- {scalar(v)}" for v in value)
        else:
            lines.append(f"{key}: {scalar(value)}")
    return "\n".join(lines) + "\n"


def existing_tags(path: Path) -> list[str]:
    """The tags in the front matter of a card already at ``path`` (kept by a new card)."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8")
    if not text.startswith("---\n"):
        return []
    front = text[4:].split("\n---", 1)[0].splitlines()
    tags, inside = [], False
    for line in front:
        if line.startswith("tags:"):
            inside = True
            continue
        if inside and line.startswith("- "):
            item = line[2:].strip()
            try:
                item = json.loads(item)
            except ValueError:
                item = item.strip("'\"")
            tags.append(str(item))
        elif inside:
            break
    return tags


def _dataset_defaults(trainer: Run) -> tuple[list[str] | None, list[Any] | None, list[dict] | None]:
    """Dataset tag, config and split of a named ``datasets`` dataset (local files name none)."""
    one = trainer.eval_dataset if trainer.eval_dataset is not None else trainer.train_dataset
    datasets = sys.modules.get("datasets")
    if datasets is None or not isinstance(one, (datasets.Dataset, datasets.IterableDataset)):
        return None, None, None
    builder = getattr(one, "builder_name", None)
    if not builder or builder in LOCAL_BUILDERS:
        return None, None, None
    return [builder], [one.config_name], [{"config": one.config_name, "split": str(one.split)}]


def model_card(trainer: Run, language: str | list[str] | None = None, license: str | None = None,
               tags: str | list[str] | None = None, model_name: str | None = None,
               finetuned_from: str | None = None, tasks: str | list[str] | None = None,
               dataset_tags: str | list[str] | None = None, dataset: str | list[str] | None = None,
               dataset_args: str | list[str] | None = None) -> str:
    """The README.md text for the Trainer's model (``Trainer.create_model_card``'s arguments)."""
    from workbench.core.trainer_utils import unwrap_model

    model = unwrap_model(trainer.model)
    card_path = Path(trainer.args.output_dir) / "README.md"
    tag_list = _as_list(tags) + [t for t in existing_tags(card_path) if t not in _as_list(tags)]
    if TAG not in tag_list:
        tag_list.append(TAG)
    default_tags, default_args, dataset_metadata = _dataset_defaults(trainer)
    dataset_tags = dataset_tags if dataset_tags is not None else default_tags
    dataset_args = dataset_args if dataset_args is not None else default_args
    if dataset is None and dataset_tags is not None:
        dataset = dataset_tags
    config = getattr(model, "config", None)
    source = getattr(config, "_name_or_path", None) if config is not None and not isinstance(config, dict) else None
    if finetuned_from is None and source and not os.path.isdir(source):
        finetuned_from = source
    if tasks is None:
        tasks = next((task for suffix, task in TASKS.items() if type(model).__name__.endswith(suffix)), None)
    name = model_name if model_name is not None else Path(trainer.args.output_dir).name
    name = name or finetuned_from or "model"
    rows, final = results_from_history(trainer.state.log_history)

    meta: dict[str, Any] = {}
    if config is not None and not isinstance(config, dict) and hasattr(model, "save_pretrained"):
        meta["library_name"] = "transformers"  # the saved folder loads with from_pretrained
    if language is not None:
        meta["language"] = _as_list(language)
    if license is not None:
        meta["license"] = license
    if finetuned_from:
        meta["base_model"] = finetuned_from
    meta["tags"] = tag_list
    if dataset_tags:
        meta["datasets"] = _as_list(dataset_tags)
    metric_names = {k.lower().replace(" ", "_"): k for k in (final or {})
                    if k.lower().replace(" ", "_") in METRIC_TYPES}
    if metric_names:
        meta["metrics"] = list(metric_names)
    meta["model-index"] = [{"name": name, "results": _index_results(tasks, dataset, dataset_tags, dataset_args,
                                                                    dataset_metadata, metric_names, final)}]

    datasets_named = _as_list(dataset)
    if not datasets_named:
        on = "an unknown dataset"
    elif len(datasets_named) == 1:
        on = f"the {datasets_named[0]} dataset"
    else:
        on = ", ".join(f"the {d}" for d in datasets_named[:-1]) + f" and the {datasets_named[-1]} datasets"
    origin = f"fine-tuned from `{finetuned_from}`" if finetuned_from else "trained from scratch"
    parts = [f"---\n{_yaml(meta)}---\n",
             "\n<!-- Written by workbench's Trainer from what it knew of the run; check it and fill in "
             "the sections marked as needing more information. -->\n",
             f"\n# {name}\n\nThis model was {origin} on {on}.\n"]
    if final is not None:
        parts.append("Results of the last evaluation:\n")
        parts.append("".join(f"- {k}: {_shown(v)}\n" for k, v in final.items()))
    for section in ("Model description", "Intended uses & limitations", "Training and evaluation data"):
        parts.append(f"\n## {section}\n\nMore information needed\n")
    parts.append("\n## Training procedure\n\n### Training hyperparameters\n\n"
                 "The following hyperparameters were used during training:\n")
    parts.append("".join(f"- {k}: {v}\n" for k, v in hyperparameters(trainer).items()))
    if rows:
        parts.append("\n### Training results\n\n" + _table(rows))
    parts.append("\n### Framework versions\n\n" + "\n".join(_framework_versions()) + "\n")
    return "".join(parts)


def _index_results(tasks, dataset, dataset_tags, dataset_args, dataset_metadata, metric_names, final) -> list:
    """model-index results: one per (task, dataset) that has a task, a dataset and metrics
    (the Hub rejects partial ones)."""
    task_list = [t for t in _as_list(tasks) if t in TASK_TITLES]
    tag_list = _as_list(dataset_tags)
    if not task_list or not tag_list or not metric_names or final is None:
        return []
    names = dict(zip(tag_list, _as_list(dataset)))
    args = dict(zip(tag_list, _as_list(dataset_args) + [None] * len(tag_list)))
    extra = dict(zip(tag_list, _as_list(dataset_metadata)))
    results = []
    for task in task_list:
        for tag in tag_list:
            entry = {"name": names.get(tag, tag), "type": tag, **extra.get(tag, {})}
            if args.get(tag) is not None:
                entry["args"] = args[tag]
            results.append({"task": {"name": TASK_TITLES[task], "type": task}, "dataset": entry,
                            "metrics": [{"name": name, "type": kind, "value": final[name]}
                                        for kind, name in metric_names.items()]})
    return results


def _table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of ``rows`` (the first row's keys are the columns)."""
    columns = list(rows[0])
    cells = [[_shown(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]

    def line(values: list[str]) -> str:
        return "".join(f"| {v:<{w}} " for v, w in zip(values, widths)) + "|\n"

    return line(columns) + "".join(f"|:{'-' * w}:" for w in widths) + "|\n" + "".join(line(r) for r in cells)
