"""From rows to batches: unused columns dropped by the model's signature, the samplers
(group_by_length, batch_rebalance across ranks and micro-batches), dataloader options and the
combinations refused, NEFTune noise, and a resume that is bitwise identical with each sampler.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import IterableDataset

from workbench import Trainer, TrainerCallback
from workbench.config.loader import ConfigError, load_config
from workbench.core.args.training import ArgumentError
from workbench.data.builtin import CharTokenizer
from workbench.data.collators import DataCollatorForLanguageModeling
from workbench.data.samplers import BatchRebalanceSampler, LengthGroupedSampler, dataset_lengths, padded_cost

from support import StopAt, hf_logs
from test_data_pipeline import LM, VOCAB, Rows, gpt, make_args, ragged_lengths

# ====================================================================== 3. column removal


def ragged_rows(n: int = 40, seed: int = 0, **extra_columns) -> Rows:
    rng = random.Random(seed + 1)
    rows = []
    for i, length in enumerate(ragged_lengths(n, seed)):
        row = {"input_ids": [rng.randint(2, VOCAB - 1) for _ in range(length)]}
        for name, fn in extra_columns.items():
            row[name] = fn(i)
        rows.append(row)
    return Rows(rows)


class MaskingCharTokenizer(CharTokenizer):
    """The CharTokenizer with <unk> doubling as a mask token, for MLM collator tests."""

    mask_token_id = 1
    all_special_ids = [0, 1]


class TargetModel(torch.nn.Module):
    """Forward takes ``x`` and ``target`` only (and **kwargs, which does not count, as in HF)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        self.seen: list[set] = []

    def forward(self, x, target=None, **kwargs):
        self.seen.append(set(kwargs) | {"x"} | ({"target"} if target is not None else set()))
        loss = ((self.linear(x).squeeze(-1) - target) ** 2).mean()
        return {"loss": loss}


def test_unused_columns_dropped_by_signature_with_one_message(tmp_path, caplog):
    rows = Rows([{"x": [float(i), 1.0], "target": float(i), "source": f"s{i}", "weight": 1.0} for i in range(8)])
    model = TargetModel()
    trainer = Trainer(model=model, args=make_args(tmp_path, max_steps=4, label_names=["target"],
                                                  eval_strategy="steps", eval_steps=2),
                      train_dataset=rows, eval_dataset=rows)
    with hf_logs(caplog, "transformers.trainer"):
        trainer.train()
    assert model.seen and all(seen == {"x", "target"} for seen in model.seen)
    messages = [r.getMessage() for r in caplog.records if "dropping columns" in r.getMessage()]
    assert messages == [
        "training: dropping columns the model's forward does not accept: source, weight "
        "(set remove_unused_columns=False to keep them)",
        "evaluation: dropping columns the model's forward does not accept: source, weight "
        "(set remove_unused_columns=False to keep them)",
    ]  # once each, although evaluation ran twice
    keep = Trainer(model=model, args=make_args(tmp_path, max_steps=1, remove_unused_columns=False),
                   train_dataset=Rows([{"x": [1.0, 1.0], "target": 1.0, "weight": 2.0}] * 4))
    model.seen.clear()
    keep.train()
    assert model.seen[0] == {"x", "target", "weight"}


def test_length_column_name_is_used_when_present(tmp_path):
    # "n_tokens" claims lengths opposite to the real ones: the sampler must follow the column.
    rows = ragged_rows(24, n_tokens=lambda i: 100 - i)
    trainer = Trainer(model=gpt(), args=make_args(tmp_path, train_sampling_strategy="group_by_length",
                                                  length_column_name="n_tokens", per_device_train_batch_size=24),
                      train_dataset=rows, data_collator=LM)
    sampler = trainer._get_train_sampler(rows)
    assert sampler.lengths == [100 - i for i in range(24)]
    assert list(sampler) == list(range(24))  # one mega-batch, sorted by the column: 100, 99, ...
    no_column = Trainer(model=gpt(), args=make_args(tmp_path, train_sampling_strategy="group_by_length"),
                        train_dataset=ragged_rows(24), data_collator=LM)
    assert no_column._get_train_sampler(no_column.train_dataset).lengths == ragged_lengths(24)


def test_lengths_of_a_datasets_dataset_come_from_arrow(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in (3, 1, 4)], "other": [0, 0, 0]})
    assert dataset_lengths(ds) == [3, 1, 4]
    assert dataset_lengths(ds.select([2, 0])) == [4, 3]  # through the indices mapping
    assert dataset_lengths(ds.add_column("length", [7, 8, 9])) == [7, 8, 9]
    with pytest.raises(ValueError, match="neither a 'length' column"):
        dataset_lengths(ds, model_input_name="x")


# ====================================================================== 4. samplers


def test_group_by_length_sorts_mega_batches_and_puts_the_longest_first():
    lengths = ragged_lengths(400, seed=3)
    sampler = LengthGroupedSampler(lengths, batch_size=4, seed=5)
    order = list(sampler)
    assert sorted(order) == list(range(400))
    assert lengths[order[0]] == max(lengths)
    mega = 4 * min(400 // 16, 50)  # 100 samples per mega-batch
    for start in range(0, 400, mega):
        chunk = [lengths[i] for i in order[start:start + mega]]
        head, rest = chunk[0], chunk[1:]
        assert rest == sorted(rest, reverse=True)
        if start:
            assert head >= rest[0]
    sampler.set_epoch(1)
    assert list(sampler) != order
    sampler.set_epoch(0)
    assert list(sampler) == order  # a pure function of (seed, epoch)

    def padding(batches):
        return sum(padded_cost(b, lengths) for b in batches) / sum(lengths) - 1

    grouped = [order[i:i + 4] for i in range(0, 400, 4)]
    shuffled = torch.randperm(400, generator=torch.Generator().manual_seed(0)).tolist()
    assert padding(grouped) < 0.1 < 0.5 < padding([shuffled[i:i + 4] for i in range(0, 400, 4)])


def _shard(batches: list[list[int]], procs: int) -> list[list[list[int]]]:
    """What accelerate's BatchSamplerShard gives each rank (verified against it below)."""
    return [batches[rank::procs] for rank in range(procs)]


@pytest.mark.parametrize("n,procs,ga,bs,drop_last", [
    (96, 2, 2, 4, False), (100, 2, 2, 4, False), (100, 2, 2, 4, True), (37, 3, 1, 5, False),
    (10, 4, 1, 8, False), (3, 4, 2, 2, False), (50, 1, 4, 3, False),
])
def test_batch_rebalance_covers_every_sample_once_per_epoch(n, procs, ga, bs, drop_last):
    from accelerate.data_loader import BatchSamplerShard

    lengths = ragged_lengths(n, seed=n)
    sampler = BatchRebalanceSampler(lengths, bs, num_processes=procs, gradient_accumulation_steps=ga,
                                    seed=2, drop_last=drop_last)
    batches = list(sampler)
    assert len(batches) == len(sampler) and len(batches) % procs == 0
    assert all(batches)  # never an empty micro-batch
    seen = sorted(i for b in batches for i in b)
    if drop_last:
        step = procs * ga * bs
        assert len(seen) == len(set(seen)) and set(seen) <= set(range(n))
        assert n - len(seen) < procs * bs  # only what cannot fill one round of micro-batches
        assert len(seen) >= n // step * step
    elif n >= procs:
        assert seen == list(range(n))  # every sample exactly once
    else:
        assert set(seen) == set(range(n)) and len(seen) == procs  # repeats only to give each rank one
    full_steps = n // (procs * ga * bs)
    for k in range(full_steps):  # per_device_train_batch_size is the average
        step = batches[k * procs * ga:(k + 1) * procs * ga]
        assert sum(len(b) for b in step) == procs * ga * bs
    shards = [list(BatchSamplerShard(sampler, procs, rank)) for rank in range(procs)]
    assert shards == _shard(batches, procs)
    sampler.set_epoch(1)
    assert list(sampler) != batches or n <= 3


def test_batch_rebalance_balances_padded_tokens_across_ranks_and_micro_batches():
    lengths = ragged_lengths(960, seed=11, short=(8, 40), long=(60, 128))
    procs, ga, bs = 2, 4, 8

    def rank_ratios(batches):
        ratios = []
        for start in range(0, len(batches), procs * ga):
            step = batches[start:start + procs * ga]
            totals = [sum(padded_cost(b, lengths) for b in step[rank::procs]) for rank in range(procs)]
            ratios.append(max(totals) / min(totals))
        return ratios

    sampler = BatchRebalanceSampler(lengths, bs, num_processes=procs, gradient_accumulation_steps=ga, seed=0)
    balanced = list(sampler)
    perm = torch.randperm(960, generator=torch.Generator().manual_seed(0)).tolist()
    plain = [perm[i:i + bs] for i in range(0, 960, bs)]
    assert max(rank_ratios(balanced)) < 1.05  # every step: both ranks within 5% of each other
    assert max(rank_ratios(plain)) > 1.3 and sum(rank_ratios(plain)) / len(plain) * procs * ga > 1.1  # random
    costs = [padded_cost(b, lengths) for b in balanced]
    for start in range(0, len(costs), procs * ga):  # and each micro-batch is near the step's mean
        step = costs[start:start + procs * ga]
        assert max(step) < 1.6 * (sum(step) / len(step))
    padding = sum(costs) / sum(lengths) - 1
    assert padding < 0.2 and sum(padded_cost(b, lengths) for b in plain) / sum(lengths) - 1 > 1.0
    sizes = [len(b) for b in balanced]
    assert min(sizes) < bs < max(sizes)  # long samples in small micro-batches, short in large


def test_iterable_dataset_ignores_the_sampler_and_needs_max_steps(tmp_path):
    class Stream(IterableDataset):
        def __iter__(self):
            for i in range(40):
                yield {"input_ids": torch.full((8,), 5 + i % 20), "labels": torch.full((8,), 5 + i % 20)}

    args = make_args(tmp_path, train_sampling_strategy="batch_rebalance")
    trainer = Trainer(model=gpt(), args=args, train_dataset=Stream())
    assert trainer._get_train_sampler(trainer.train_dataset) is None
    with pytest.raises(ValueError, match="max_steps: the train dataset has no length"):
        trainer.train()
    trainer = Trainer(model=gpt(), args=make_args(tmp_path, max_steps=3, train_sampling_strategy="group_by_length"),
                      train_dataset=Stream())
    assert trainer.train().global_step == 3


def test_batch_rebalance_trains_with_gradient_accumulation(tmp_path):
    seen: list[list[int]] = []

    def collate(features):
        seen.append([f["idx"] for f in features])
        return LM([{"input_ids": f["input_ids"]} for f in features])

    rows = ragged_rows(40, idx=lambda i: i)
    args = make_args(tmp_path, train_sampling_strategy="batch_rebalance", gradient_accumulation_steps=2,
                     num_train_epochs=1, remove_unused_columns=False)
    result = Trainer(model=gpt(), args=args, train_dataset=rows, data_collator=collate).train()
    assert result.global_step == 5  # 40 samples / (2 micro-batches x 4 on average)
    assert sorted(i for batch in seen for i in batch) == list(range(40))
    assert len({len(b) for b in seen}) > 1


# ====================================================================== 5. dataloader options


@pytest.mark.parametrize("options,key", [
    ({"dataloader_prefetch_factor": 2}, "dataloader_prefetch_factor"),
    ({"dataloader_persistent_workers": True}, "dataloader_persistent_workers"),
    ({"dataloader_multiprocessing_context": "spawn"}, "dataloader_multiprocessing_context"),
    ({"dataloader_num_workers": 1, "dataloader_multiprocessing_context": "threads"}, "dataloader_multiprocessing_context"),
    ({"dataloader_num_workers": 1, "dataloader_prefetch_factor": 0}, "dataloader_prefetch_factor"),
    ({"train_sampling_strategy": "longest_first"}, "train_sampling_strategy"),
])
def test_forbidden_dataloader_combinations_are_clear_errors(tmp_path, options, key):
    with pytest.raises(ArgumentError) as info:
        make_args(tmp_path, **options)
    assert info.value.key == key and str(info.value).startswith(f"{key}: ")


def test_forbidden_combination_in_a_config_points_at_the_line(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\nbuiltin = "tiny-gpt"\n[data]\nbuiltin = "python-source"\n[training]\n'
                   'dataloader_prefetch_factor = 2\n')
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    assert str(info.value) == (f"{cfg}:6: training.dataloader_prefetch_factor: only applies with "
                               "dataloader_num_workers > 0")


def test_batch_rebalance_refuses_split_or_dispatched_batches(tmp_path):
    args = make_args(tmp_path, train_sampling_strategy="batch_rebalance", accelerator_config={"split_batches": True})
    trainer = Trainer(model=gpt(), args=args, train_dataset=ragged_rows(8), data_collator=LM)
    with pytest.raises(ValueError, match="unset accelerator_config split_batches and dispatch_batches"):
        trainer.get_train_dataloader()


def test_dataloader_options_reach_the_loader(tmp_path):
    args = make_args(tmp_path, dataloader_num_workers=2, dataloader_persistent_workers=True,
                     dataloader_prefetch_factor=3, dataloader_multiprocessing_context="fork",
                     dataloader_in_order=False, dataloader_drop_last=True)
    trainer = Trainer(model=gpt(), args=args, train_dataset=ragged_rows(10), data_collator=LM)
    loader = trainer.get_train_dataloader()
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (2, True, 3)
    assert loader.multiprocessing_context.get_start_method() == "fork" and loader.in_order is False
    assert len(loader) == 2 and all(b["input_ids"].shape[0] == 4 for b in loader)  # the last 2 dropped


# ====================================================================== 6. NEFTune


def test_neftune_noise_is_bounded_training_only_and_removable():
    from workbench.train.neftune import activate_neftune

    model = gpt(n_embd=32)
    ids = torch.randint(2, VOCAB, (3, 20))
    plain = model.get_input_embeddings()(ids)
    handle = activate_neftune(model, 5.0)
    model.train()
    noisy = model.get_input_embeddings()(ids)
    bound = 5.0 / (20 * 32) ** 0.5
    delta = noisy - plain
    assert 0 < delta.abs().max() <= bound + 1e-6 and delta.abs().max() > 0.8 * bound
    model.eval()
    assert torch.equal(model.get_input_embeddings()(ids), plain)
    handle.remove()
    model.train()
    assert torch.equal(model.get_input_embeddings()(ids), plain)
    with pytest.raises(ValueError, match="has no get_input_embeddings"):
        activate_neftune(torch.nn.Linear(2, 2), 5.0)


def test_neftune_in_training_not_in_evaluation_and_restored_after(tmp_path):
    class Probe(TrainerCallback):
        def __init__(self):
            self.hooked_in_training, self.eval_clean = [], []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.hooked_in_training.append(bool(model.get_input_embeddings()._forward_hooks))

        def on_evaluate(self, args, state, control, model=None, **kwargs):
            ids = torch.arange(2, 18).reshape(1, -1)
            was = model.training
            model.eval()
            with_hook = model(ids)["logits"]
            hooks = dict(model.get_input_embeddings()._forward_hooks)
            model.get_input_embeddings()._forward_hooks.clear()
            without = model(ids)["logits"]
            model.get_input_embeddings()._forward_hooks.update(hooks)
            model.train(was)
            self.eval_clean.append(torch.equal(with_hook, without))

    rows = ragged_rows(16)
    probe = Probe()
    noisy = Trainer(model=gpt(), args=make_args(tmp_path, max_steps=4, neftune_noise_alpha=5.0, eval_strategy="steps",
                                                eval_steps=2), train_dataset=rows, eval_dataset=rows,
                    data_collator=LM, callbacks=[probe])
    noisy.train()
    assert probe.hooked_in_training == [True] * 4 and probe.eval_clean == [True, True]
    assert not noisy.model.get_input_embeddings()._forward_hooks and noisy.neftune_hook_handle is None
    clean = Trainer(model=gpt(), args=make_args(tmp_path, max_steps=4), train_dataset=rows, data_collator=LM)
    clean.train()
    assert not torch.equal(noisy.model.wte.weight, clean.model.wte.weight)  # the noise changed training
    # The same evaluations too: as in HF, each one draws from the global RNG the noise comes from.
    again = Trainer(model=gpt(), args=make_args(tmp_path, max_steps=4, neftune_noise_alpha=5.0, eval_strategy="steps",
                                                eval_steps=2), train_dataset=rows, eval_dataset=rows, data_collator=LM)
    again.train()
    assert torch.equal(again.model.wte.weight, noisy.model.wte.weight)  # seeded: reproducible


# ====================================================================== 7. exact resume


def _run(out, *, stop=None, resume=None, model_seed=0, collator=LM, rows=None, **overrides) -> Trainer:
    args = make_args(out, max_steps=12, gradient_accumulation_steps=2, **overrides)
    trainer = Trainer(model=gpt(model_seed, dropout=0.1), args=args, train_dataset=rows or ragged_rows(40),
                      data_collator=collator, callbacks=[StopAt(stop)] if stop else None)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _same(a: Trainer, b: Trainer) -> None:
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), f"parameter {name} differs"
    la = [(h["step"], h["loss"]) for h in a.state.log_history if "loss" in h]
    lb = [(h["step"], h["loss"]) for h in b.state.log_history if "loss" in h]
    assert la == lb and len(la) == 12


@pytest.mark.parametrize("strategy", ["random", "sequential", "group_by_length", "batch_rebalance"])
def test_resume_is_bitwise_identical_with_each_sampler(tmp_path, strategy):
    full = _run(tmp_path / "full", train_sampling_strategy=strategy)
    _run(tmp_path / "cut", stop=7, train_sampling_strategy=strategy)  # mid second epoch (5 steps an epoch)
    resumed = _run(tmp_path / "cut", resume=True, model_seed=9, train_sampling_strategy=strategy)
    _same(full, resumed)


def test_resume_is_exact_with_seeded_mlm_masking_in_workers_and_neftune(tmp_path):
    def options():
        return {"collator": DataCollatorForLanguageModeling(MaskingCharTokenizer(), mlm=True, seed=3),
                "train_sampling_strategy": "batch_rebalance", "dataloader_num_workers": 2,
                "neftune_noise_alpha": 5.0, "data_seed": 4}

    full = _run(tmp_path / "full", **options())
    _run(tmp_path / "cut", stop=6, **options())
    resumed = _run(tmp_path / "cut", resume=True, model_seed=9, **options())
    _same(full, resumed)


# ====================================================================== 8. two processes
