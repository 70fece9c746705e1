"""The Trainer methods scripts call around a run, with transformers' behaviour: printing and
saving metrics (``log_metrics``, ``save_metrics``, ``metrics_format``), the state file
(``save_state``), the model card (``create_model_card``), the floating-point-operation count
(``floating_point_ops``, ``store_flos``), the learning rate HF logs (``_get_learning_rate``),
and ``push_to_hub``, which workbench refuses in one line (it never reaches the network).

``TrainerReports`` is a mixin of ``Trainer``: these methods only read the Trainer's args,
state, model and accelerator, so they live apart from the training code.
"""

from __future__ import annotations

import datetime
import inspect
import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["TrainerReports", "metrics_format"]


def _clock(seconds: float) -> str:
    """``h:mm:ss.cc`` (hundredths cut, not rounded), the form HF prints runtimes in."""
    hundredths = int(abs(seconds - int(seconds)) * 100)
    return f"{datetime.timedelta(seconds=int(seconds))}.{hundredths:02d}"


def metrics_format(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` made readable, as HF's: memory in MB, runtimes as clock times,
    ``total_flos`` in GF, other floats rounded to 4 decimals (a new dict)."""
    out = dict(metrics)
    for key, value in out.items():
        if "_mem_" in key:
            out[key] = f"{int(value) >> 20}MB"
        elif "_runtime" in key:
            out[key] = _clock(value)
        elif key == "total_flos":
            out[key] = f"{int(value) >> 30}GF"
        elif isinstance(value, float):
            out[key] = round(value, 4)
    return out


def _flos_rule(model: Any) -> tuple[Any, str, int | None]:
    """How ``floating_point_ops`` counts for ``model``: its own method (or None), the name of
    its main input, and its non-embedding parameter count (None: it does not count them)."""
    own = getattr(model, "floating_point_ops", None)
    name = getattr(model, "main_input_name", "input_ids")
    count = None
    if not callable(own) and hasattr(model, "num_parameters"):
        takes = "exclude_embeddings" in inspect.signature(model.num_parameters).parameters
        count = int(model.num_parameters(exclude_embeddings=True) if takes else model.num_parameters())
    return (own if callable(own) else None), name, count


class TrainerReports:
    """Reporting methods of the HF Trainer (mixed into ``Trainer``)."""

    # Floating-point operations of this process since the last ``store_flos`` (HF's name).
    current_flos: float = 0
    _flos_plan: tuple[Any, Any, str, int | None] | None = None  # (model, own method, input name, count)

    # HF's is a function placed in the class; here it works on the class and on an instance.
    metrics_format = staticmethod(metrics_format)

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print ``metrics`` of ``split`` (train / eval / test) in HF's layout: a header, then
        one aligned ``key = value`` line per metric, sorted (main process only)."""
        if not self.is_world_process_zero():
            return
        print(f"***** {split} metrics *****")
        shown = metrics_format(metrics)
        key_width = max((len(str(k)) for k in shown), default=0)
        value_width = max((len(str(v)) for v in shown.values()), default=0)
        for key in sorted(shown):
            print(f"  {key: <{key_width}} = {shown[key]:>{value_width}}")

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """Write ``{split}_results.json`` into output_dir and, with ``combined``, merge the
        metrics into ``all_results.json`` (main process only), as HF does."""
        if not self.is_world_process_zero():
            return
        out = Path(self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{split}_results.json").write_text(json.dumps(metrics, indent=4, sort_keys=True), encoding="utf-8")
        if combined:
            path = out / "all_results.json"
            merged = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            merged.update(metrics)
            path.write_text(json.dumps(merged, indent=4, sort_keys=True), encoding="utf-8")

    def save_state(self) -> None:
        """Write the TrainerState to ``output_dir/trainer_state.json`` (main process only)."""
        if not self.is_world_process_zero():
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        self.state.save_to_json(os.path.join(self.args.output_dir, "trainer_state.json"))

    def floating_point_ops(self, inputs: Any) -> int:
        """Floating-point operations of one forward and backward pass over ``inputs``.

        The model's own ``floating_point_ops(inputs)`` when it has one (transformers 4.x
        models did); else HF 5.x's estimate, 6 x input tokens x non-embedding parameters, for
        a model that counts its parameters (``num_parameters``, as transformers models do);
        else 0. Override it to count another way. Called once per micro-batch, so what it
        looks up on the model is looked up once per model."""
        model = self.model
        plan = self._flos_plan
        if plan is None or plan[0] is not model:
            plan = self._flos_plan = (model, *_flos_rule(model))
        _, own, name, count = plan
        if own is not None:
            return own(inputs)
        if count is None or name not in inputs:
            return 0
        return 6 * inputs[name].numel() * count

    def store_flos(self) -> None:
        """Add this process's operations since the last call to ``state.total_flos``, summed
        over processes (a collective with several: every rank calls it at the same points)."""
        flos = float(self.current_flos)
        if self.accelerator.num_processes > 1:
            device = self.accelerator.device
            dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
            flos = float(self.accelerator.gather(torch.tensor([flos], dtype=dtype, device=device)).sum())
        self.state.total_flos += flos
        self.current_flos = 0

    def _get_learning_rate(self) -> float:
        """The learning rate of the first parameter group as the schedule last set it: read
        after the optimizer step and before the schedule's, it is the rate that step used
        (the one HF logs for it)."""
        scheduler = self.lr_scheduler
        if scheduler is None or isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            lr = self.optimizer.param_groups[0]["lr"]
        else:
            lr = scheduler.get_last_lr()[0]
        return lr.item() if torch.is_tensor(lr) else lr

    def create_model_card(self, language: str | None = None, license: str | None = None,
                          tags: str | list[str] | None = None, model_name: str | None = None,
                          finetuned_from: str | None = None, tasks: str | list[str] | None = None,
                          dataset_tags: str | list[str] | None = None, dataset: str | list[str] | None = None,
                          dataset_args: str | list[str] | None = None) -> None:
        """Write a draft model card, ``output_dir/README.md``, from what the Trainer knows:
        model name, base model, hyperparameters, the evaluation results of the log history
        and the framework versions (main process only; offline: nothing is looked up)."""
        if not self.is_world_process_zero():
            return
        from workbench.train.model_card import model_card

        text = model_card(self, language=language, license=license, tags=tags, model_name=model_name,
                          finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags, dataset=dataset,
                          dataset_args=dataset_args)
        os.makedirs(self.args.output_dir, exist_ok=True)
        Path(self.args.output_dir, "README.md").write_text(text, encoding="utf-8")

    def push_to_hub(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: workbench never uploads (no network from the Trainer)."""
        raise RuntimeError(f"push_to_hub: workbench does not upload to the Hugging Face Hub; the model is saved in "
                           f"{self.args.output_dir} (save_model() / create_model_card()): upload that folder with "
                           "huggingface_hub's upload_folder")

    def init_hf_repo(self, *args: Any, **kwargs: Any) -> None:
        """Refused, as push_to_hub: workbench creates no Hub repository."""
        raise RuntimeError("init_hf_repo: workbench does not create Hugging Face Hub repositories; "
                           "use huggingface_hub's create_repo")
