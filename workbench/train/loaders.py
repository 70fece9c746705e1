"""The Trainer's data loaders, HF's override points: ``get_train_dataloader``,
``get_eval_dataloader``, ``get_test_dataloader`` and the sampler and collator they use.

A mixin of ``Trainer``: it reads the Trainer's arguments, datasets, collator and Accelerator.
Every loader is prepared by Accelerate (sharded across processes). The training loader's
order is a function of (seed, epoch) alone (data/samplers.py), so a resumed run re-creates
the epoch's order and skips what was consumed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from workbench.core.trainer_utils import has_length, unwrap_model
from workbench.data.collators import RemoveColumnsCollator, signature_columns
from workbench.data.samplers import (
    BatchRebalanceSampler,
    EpochRandomSampler,
    EpochSequentialSampler,
    LengthGroupedSampler,
    dataset_lengths,
)

__all__ = ["TrainerData"]


class TrainerData:
    """The data loaders of a Trainer (mixed into it)."""

    def _collator_for(self, dataset: Any, description: str) -> Callable:
        if not self.args.remove_unused_columns:
            return self.data_collator
        keep = signature_columns(unwrap_model(self.model), self.label_names)
        # One set per Trainer: each dropped-columns message is shown once, not every evaluation.
        reported = self.__dict__.setdefault("_dropped_columns_reported", set())
        return RemoveColumnsCollator(self.data_collator, keep, description, reported,
                                     quiet=[self.args.length_column_name])

    def _loader_kwargs(self) -> dict[str, Any]:
        args = self.args
        kwargs: dict[str, Any] = {
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory and self.accelerator.device.type == "cuda",
        }
        if args.dataloader_num_workers > 0:
            kwargs["persistent_workers"] = args.dataloader_persistent_workers
            kwargs["prefetch_factor"] = args.dataloader_prefetch_factor
            kwargs["multiprocessing_context"] = args.dataloader_multiprocessing_context
            kwargs["in_order"] = args.dataloader_in_order
        return kwargs

    def _get_train_sampler(self, dataset: Dataset) -> torch.utils.data.Sampler | None:
        """The sampler of ``train_sampling_strategy`` (None for an IterableDataset, which has no
        order to choose). "batch_rebalance" returns a batch sampler (see samplers.py)."""
        if isinstance(dataset, IterableDataset) or not has_length(dataset):
            return None
        args = self.args
        strategy = args.train_sampling_strategy
        if strategy == "sequential":
            return EpochSequentialSampler(dataset)
        seed = args.data_seed if args.data_seed is not None else args.seed
        if strategy == "group_by_length":
            return LengthGroupedSampler(self._sample_lengths(dataset),
                                        self._train_batch_size * args.gradient_accumulation_steps, seed=seed)
        if strategy == "batch_rebalance":
            config = self.accelerator.dataloader_config
            if config.split_batches or config.dispatch_batches:
                raise ValueError('train_sampling_strategy="batch_rebalance" plans every rank\'s micro-batches '
                                 "itself: unset accelerator_config split_batches and dispatch_batches")
            return BatchRebalanceSampler(self._sample_lengths(dataset), self._train_batch_size,
                                         num_processes=self.accelerator.num_processes,
                                         gradient_accumulation_steps=args.gradient_accumulation_steps,
                                         seed=seed, drop_last=args.dataloader_drop_last)
        return EpochRandomSampler(dataset, seed=seed)

    def _sample_lengths(self, dataset: Dataset) -> list[int]:
        """Sample lengths for the length-aware samplers, computed once per dataset and Trainer."""
        cache = self.__dict__.setdefault("_lengths_cache", {})
        hit = cache.get(id(dataset))
        if hit is None or hit[0] is not dataset:
            names = getattr(self.processing_class, "model_input_names", None)
            name = names[0] if names else getattr(unwrap_model(self.model), "main_input_name",
                                                  "input_ids")
            hit = cache[id(dataset)] = (dataset, dataset_lengths(dataset, self.args.length_column_name, name))
        return hit[1]

    def get_train_dataloader(self) -> DataLoader:
        """The training DataLoader, prepared by Accelerate (sharded across processes)."""
        if self.train_dataset is None:
            raise ValueError("Trainer.train needs a train_dataset")
        dataset = self.train_dataset
        sampler = self._get_train_sampler(dataset)
        if isinstance(sampler, BatchRebalanceSampler):
            batching: dict[str, Any] = {"batch_sampler": sampler}  # sizes vary: it batches itself
        else:
            batching = {"batch_size": self._train_batch_size, "sampler": sampler,
                        "drop_last": self.args.dataloader_drop_last}
        # The loop starts each epoch through the returned loader alone (its samplers' and
        # collator's set_epoch, its generator re-seeded: samplers.start_loader_epoch). The
        # worker base seed comes from this generator, not the global RNG, so starting an
        # iterator (also mid-run, on resume) never shifts dropout or other draws.
        loader = DataLoader(
            dataset,
            generator=torch.Generator(),
            collate_fn=self._collator_for(dataset, "training"),
            **batching,
            **self._loader_kwargs(),
        )
        return self.accelerator.prepare(loader)

    def _resolve_eval_dataset(self, eval_dataset: Dataset | str | None) -> Dataset:
        if isinstance(eval_dataset, str):
            if not isinstance(self.eval_dataset, dict) or eval_dataset not in self.eval_dataset:
                names = sorted(self.eval_dataset) if isinstance(self.eval_dataset, dict) else []
                raise ValueError(f"no eval dataset named {eval_dataset!r}; named sets: {', '.join(names) or 'none'}")
            return self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluation needs an eval_dataset (pass one to Trainer or to evaluate())")
        return dataset

    def _eval_loader(self, dataset: Dataset, description: str, draws: bool = True) -> DataLoader:
        # As HF's, an evaluation's iterator draws its base seed from the global RNG, so the
        # training after it sees HF's numbers (a checkpoint is written after its step's
        # evaluation: a resume stays exact). ``draws`` False: the loader owns a generator.
        loader = DataLoader(
            dataset,
            batch_size=self.args.eval_batch_size,
            sampler=None if isinstance(dataset, IterableDataset) else EpochSequentialSampler(dataset),
            generator=None if draws else torch.Generator().manual_seed(self.args.seed),
            collate_fn=self._collator_for(dataset, description),
            drop_last=self.args.dataloader_drop_last,
            **self._loader_kwargs(),
        )
        return self.accelerator.prepare(loader)

    def get_eval_dataloader(self, eval_dataset: Dataset | str | None = None) -> DataLoader:
        """The evaluation DataLoader (sequential; a name selects one of several eval sets).

        With ``dataloader_persistent_workers`` each loader is built once and reused, as in HF,
        so its worker pool lives across evaluations instead of starting at each one.
        """
        key = eval_dataset if isinstance(eval_dataset, str) else "eval"
        reuse = self.args.dataloader_persistent_workers and (eval_dataset is None or isinstance(eval_dataset, str))
        if reuse and key in self._eval_dataloaders:
            return self._eval_dataloaders[key]
        # Persistent workers keep one iterator: HF draws at a set's first evaluation only (a
        # resumed run finds that one in its log history).
        logged = "eval_runtime" if key == "eval" else f"eval_{key}_runtime"
        draws = not (reuse and self.args.dataloader_num_workers > 0
                     and any(logged in entry for entry in self.state.log_history))
        loader = self._eval_loader(self._resolve_eval_dataset(eval_dataset), "evaluation", draws)
        if reuse:
            self._eval_dataloaders[key] = loader
        return loader

    def get_test_dataloader(self, test_dataset: Dataset) -> DataLoader:
        """The prediction DataLoader for ``test_dataset``."""
        return self._eval_loader(test_dataset, "prediction")

    def num_examples(self, dataloader: DataLoader) -> int:
        """Number of examples behind a DataLoader (its dataset's length)."""
        dataset = getattr(dataloader, "dataset", None)
        if dataset is not None and has_length(dataset):
            return len(dataset)
        return len(dataloader) * self.args.per_device_train_batch_size
