"""The data pipeline: loaders ([data] through datasets), collators, column removal, the
sampling strategies (ordering properties and exact resume), dataloader options, NEFTune,
and batch_rebalance under a real 2-process ``accelerate launch`` (slow).

Everything is small: TinyGPT with 16-32 dim embeddings on a few dozen ragged rows, files
written by the tests into tmp_path.
"""

from __future__ import annotations

import csv
import functools
import json
import random
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from workbench import Trainer
from workbench.config.loader import load_config
from workbench.data.builtin import CharTokenizer
from workbench.data.collators import (
    DataCollatorForLanguageModeling,
    DataCollatorForSeq2Seq,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    default_data_collator,
)
from workbench.data.datasets_io import load_split, load_tokenizer, rename_columns, tokenize_dataset

from support import hf_logs, tiny_gpt
from support import make_args as _make_args

make_args = functools.partial(_make_args, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                              learning_rate=1e-2, seed=1)
VOCAB = 99  # the CharTokenizer's


# ----------------------------------------------------------------------------- helpers


class Rows(Dataset):
    """A map-style dataset of dict rows (ragged lists), like a tokenized datasets.Dataset."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return dict(self.rows[index])


def ragged_lengths(n: int, seed: int = 0, short=(3, 10), long=(20, 30), p_long: float = 0.3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(*long) if rng.random() < p_long else rng.randint(*short) for _ in range(n)]


# tiny_gpt(seed, **overrides) over the CharTokenizer's vocabulary, 32 positions.
gpt = functools.partial(tiny_gpt, vocab_size=VOCAB, block_size=32)


LM = DataCollatorForLanguageModeling(CharTokenizer(), mlm=False)


# ====================================================================== 1. loading


def _rows(n: int = 6) -> list[dict]:
    return [{"text": f"sample {i} " + "x" * i, "label": i % 2} for i in range(n)]


def write_all_formats(folder: Path) -> dict[str, Path]:
    """The same six rows as jsonl, json, csv, parquet and arrow, and their texts as .txt."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows()
    files = {}
    files["jsonl"] = folder / "d.jsonl"
    files["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    files["json"] = folder / "d.json"
    files["json"].write_text(json.dumps(rows))
    files["csv"] = folder / "d.csv"
    with files["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["text", "label"])
        writer.writeheader()
        writer.writerows(rows)
    table = pa.Table.from_pylist(rows)
    files["parquet"] = folder / "d.parquet"
    pq.write_table(table, files["parquet"])
    files["arrow"] = folder / "d.arrow"
    with pa.OSFile(str(files["arrow"]), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    files["text"] = folder / "d.txt"
    files["text"].write_text("".join(r["text"] + "\n" for r in rows))
    return files


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "arrow", "text"])
def test_each_local_file_kind_loads_by_builder_and_by_path(tmp_path, kind):
    files = write_all_formats(tmp_path)
    builder = {"jsonl": "json"}.get(kind, kind)
    by_builder = load_split({"path": builder, "data_files": str(files[kind])})
    by_path = load_split({"path": str(files[kind])})
    expected = [r["text"] for r in _rows()]
    for ds in (by_builder, by_path):
        assert len(ds) == 6
        assert list(ds["text"]) == expected
        if kind != "text":
            assert list(ds["label"]) == [0, 1, 0, 1, 0, 1]


def test_splits_and_slicing_of_files(tmp_path):
    files = write_all_formats(tmp_path)
    head = load_split({"path": "json", "data_files": str(files["jsonl"]), "split": "train[:50%]"})
    tail = load_split({"path": str(files["jsonl"]), "split": "train[4:]"})
    assert list(head["label"]) == [0, 1, 0] and len(tail) == 2
    named = load_split({"path": "json", "data_files": {"train": str(files["jsonl"]), "test": str(files["json"])},
                        "split": "test[-2:]"})
    assert list(named["text"]) == [r["text"] for r in _rows()[-2:]]


def test_load_from_disk_folders_with_split_and_slices(tmp_path):
    import datasets

    rows = _rows(10)
    single = datasets.Dataset.from_list(rows)
    single.save_to_disk(str(tmp_path / "single"))
    datasets.DatasetDict({"train": single, "validation": single.select(range(4))}).save_to_disk(str(tmp_path / "dd"))
    assert len(load_split({"path": str(tmp_path / "single")})) == 10
    assert list(load_split({"path": str(tmp_path / "single"), "split": "train[2:5]"})["label"]) == [0, 1, 0]
    assert len(load_split({"path": str(tmp_path / "dd"), "split": "validation"})) == 4
    assert len(load_split({"path": str(tmp_path / "dd"), "split": "train[:30%]"})) == 3
    with pytest.raises(ValueError, match="no split 'test'; splits: train, validation"):
        load_split({"path": str(tmp_path / "dd"), "split": "test"})


def test_hub_dataset_offline_is_one_clear_line_and_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(RuntimeError) as info:
        load_split({"path": "someone/no-such-dataset-xyz"}, "data.train")
    message = str(info.value)
    assert time.perf_counter() - start < 10  # no network retries with back-off
    assert "\n" not in message
    assert message.startswith("data.train.path: 'someone/no-such-dataset-xyz' is a data set on the Hugging Face Hub")
    assert "cannot be reached" in message and 'path = "json", data_files = "train.jsonl"' in message


def test_unknown_file_extension_and_missing_rename_column(tmp_path):
    (tmp_path / "d.xyz").write_text("?")
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_split({"path": str(tmp_path / "d.xyz")})
    ds = load_split({"path": str(write_all_formats(tmp_path)["jsonl"])})
    assert rename_columns(ds, {"text": "body"}).column_names == ["body", "label"]
    with pytest.raises(ValueError, match="no column 'txt' to rename; columns: text, label"):
        rename_columns(ds, {"txt": "body"})


def test_tokenize_char_truncates_adds_lengths_and_caches(tmp_path):
    ds = load_split({"path": str(write_all_formats(tmp_path)["jsonl"])})
    tok = CharTokenizer()
    cache = tmp_path / "cache"
    out = tokenize_dataset(ds, tok, text_column="text", max_length=12, length_column="length",
                           cache_dir=cache, progress=False)
    assert out.column_names == ["label", "input_ids", "length"]
    assert [len(x) for x in out["input_ids"]] == [min(len(r["text"]), 12) for r in _rows()]
    assert list(out["length"]) == [len(x) for x in out["input_ids"]]
    assert tok.decode(out[0]["input_ids"]) == "sample 0 "
    files = sorted(cache.glob("tokenized-*.arrow"))
    assert len(files) == 1 and out.cache_files[0]["filename"] == str(files[0])
    mtime = files[0].stat().st_mtime_ns
    again = tokenize_dataset(ds, tok, text_column="text", max_length=12, length_column="length",
                             cache_dir=cache, progress=False)
    assert files[0].stat().st_mtime_ns == mtime and again["input_ids"] == out["input_ids"]  # reused
    tokenize_dataset(ds, tok, text_column="text", max_length=10, cache_dir=cache, progress=False)
    assert len(list(cache.glob("tokenized-*.arrow"))) == 2  # another option, another cache file
    with pytest.raises(ValueError, match="no column 'body' in the data; columns: text, label"):
        tokenize_dataset(ds, tok, text_column="body", progress=False)


def test_packing_cuts_concatenated_texts_into_blocks(tmp_path):
    ds = load_split({"path": str(write_all_formats(tmp_path)["jsonl"])})
    tok = CharTokenizer()
    packed = tokenize_dataset(ds, tok, text_column="text", max_length=8, packing=True, progress=False)
    stream = [i for r in _rows() for i in tok.encode(r["text"])]
    assert packed.column_names == ["input_ids", "labels"]
    assert len(packed) == len(stream) // 8
    assert [i for row in packed["input_ids"] for i in row] == stream[:len(packed) * 8]
    assert packed["labels"] == packed["input_ids"]


def test_transformers_tokenizer_folder_needs_transformers(tmp_path):
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match=r"needs the transformers package \(pip install 'workbench\[hf\]'\)"):
            load_tokenizer(str(tmp_path))
    else:
        with pytest.raises(RuntimeError, match="cannot load a tokenizer"):
            load_tokenizer(str(tmp_path))


DATA_HEAD = '[model]\nbuiltin = "tiny-gpt"\n[model.options]\nn_layer = 1\nn_embd = 16\nn_head = 2\n'


def test_config_data_pipeline_end_to_end(tmp_path, caplog):
    rows = [{"body": "def f(x):\n    return x\n" * (1 + i % 4), "id": i} for i in range(24)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "c.toml"
    cfg.write_text(DATA_HEAD + textwrap.dedent("""\
        [data]
        train = { path = "train.jsonl", split = "train[:20]" }
        eval = { path = "train.jsonl", split = "train[20:]" }
        columns = { body = "text" }
        text_column = "text"
        max_length = 32
        [training]
        output_dir = "out"
        max_steps = 2
        per_device_train_batch_size = 4
        train_sampling_strategy = "group_by_length"
        report_to = "none"
        disable_tqdm = true
        """))
    from workbench.config.build import build_trainer

    run = load_config(cfg)
    assert run.data.columns == {"body": "text"} and run.data.max_length == 32 and not run.data.packing
    trainer = build_trainer(run, progress=False)
    assert isinstance(trainer.processing_class, CharTokenizer)
    assert isinstance(trainer.data_collator, DataCollatorForLanguageModeling) and not trainer.data_collator.mlm
    assert trainer.model.block_size == 32 and trainer.model.config["vocab_size"] == VOCAB
    assert len(trainer.train_dataset) == 20 and len(trainer.eval_dataset) == 4
    assert "length" in trainer.train_dataset.column_names  # for group_by_length, no scan needed
    assert list((tmp_path / "out" / "data_cache").glob("tokenized-*.arrow"))
    with hf_logs(caplog, "transformers.trainer"):
        batch = next(iter(trainer.get_train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}  # id and length dropped
    # ... but only "id" is worth a word: the length column is the sampler's, added by workbench
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "training: dropping columns the model's forward does not accept: id"]
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))


# ====================================================================== 2. collators


class FakeTokenizer:
    """Just what the collators read from a tokenizer."""

    pad_token_id = 0
    mask_token_id = 3
    all_special_ids = [0, 1, 2, 3]
    padding_side = "right"
    model_input_names = ["input_ids", "attention_mask"]

    def __len__(self) -> int:
        return 50

    def __call__(self, text):
        return {"input_ids": [10 + ord(c) % 40 for c in text]}


def test_padding_collator_pads_masks_and_renames_label():
    tok = FakeTokenizer()
    features = [{"input_ids": [5, 6, 7], "label": 1, "note": "x"}, {"input_ids": [8], "label": 0, "note": "y"}]
    batch = DataCollatorWithPadding(tok)(features)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}  # strings left out, label -> labels
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [1, 0] and batch["labels"].dtype == torch.long
    multiple = DataCollatorWithPadding(tok, pad_to_multiple_of=4)(features)
    assert multiple["input_ids"].shape == (2, 4)
    fixed = DataCollatorWithPadding(tok, padding="max_length", max_length=6)(features)
    assert fixed["input_ids"].shape == (2, 6)
    tok.padding_side = "left"
    left = DataCollatorWithPadding(tok)(features)
    assert left["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]] and left["attention_mask"][1].tolist() == [0, 0, 1]
    equal = DataCollatorWithPadding(CharTokenizer())([{"input_ids": torch.tensor([4, 5])}] * 2)
    assert equal["attention_mask"].tolist() == [[1, 1], [1, 1]]  # always returned, as HF


def test_padding_without_pad_token_is_a_clear_error():
    tok = FakeTokenizer()
    tok.pad_token_id = None
    with pytest.raises(ValueError, match="no pad token"):
        DataCollatorWithPadding(tok)([{"input_ids": [1, 2]}, {"input_ids": [1]}])


def test_causal_lm_collator_labels_and_padding():
    batch = DataCollatorForLanguageModeling(FakeTokenizer(), mlm=False)([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
    assert batch["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    own = DataCollatorForLanguageModeling(FakeTokenizer(), mlm=False)(
        [{"input_ids": [5, 6], "labels": [-100, 6]}, {"input_ids": [8], "labels": [8]}])
    assert own["labels"].tolist() == [[-100, 6], [8, -100]]  # given labels kept, padded with -100


def test_mlm_collator_dynamic_masking_is_seeded_and_skips_special_and_padding():
    tok = FakeTokenizer()
    rng = random.Random(0)
    features = [{"input_ids": [1] + [rng.randint(10, 49) for _ in range(n)] + [2]} for n in (60, 40, 20)]
    collator = DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.3, seed=7)
    batch = collator(features)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    original = DataCollatorWithPadding(tok)(features)["input_ids"]
    selected = labels != -100
    assert 0.15 < selected[mask.bool()].float().mean() < 0.45
    assert (labels[selected] == original[selected]).all()  # labels are the original tokens
    assert not selected[mask == 0].any()  # padding never masked
    assert not selected[torch.isin(original, torch.tensor(tok.all_special_ids))].any()  # nor special tokens
    assert (ids[~selected] == original[~selected]).all()  # unselected tokens unchanged
    masked = (ids == tok.mask_token_id) & selected
    assert 0.6 < masked.sum() / selected.sum() < 0.95  # ~80% become the mask token
    again = collator(features)
    assert torch.equal(again["input_ids"], ids) and torch.equal(again["labels"], labels)  # pure function
    collator.set_epoch(1)
    assert not torch.equal(collator(features)["labels"], labels)  # a new epoch masks afresh
    with pytest.raises(ValueError, match="needs a tokenizer with a mask token"):
        DataCollatorForLanguageModeling(CharTokenizer(), mlm=True)


def test_seq2seq_collator_pads_labels_separately_with_minus_100():
    class Model:
        def prepare_decoder_input_ids_from_labels(self, labels):
            return torch.where(labels == -100, 0, labels).roll(1, dims=1)

    features = [{"input_ids": [5, 6, 7], "labels": [9]}, {"input_ids": [8], "labels": [9, 9, 9, 9]}]
    batch = DataCollatorForSeq2Seq(FakeTokenizer(), model=Model())(features)
    assert batch["input_ids"].shape == (2, 3) and batch["labels"].shape == (2, 4)
    assert batch["labels"].tolist() == [[9, -100, -100, -100], [9, 9, 9, 9]]
    assert batch["decoder_input_ids"].shape == (2, 4)


def test_token_classification_collator_aligns_labels_with_tokens():
    features = [{"input_ids": [5, 6, 7], "labels": [1, 2, 1]}, {"input_ids": [8], "labels": [2]}]
    batch = DataCollatorForTokenClassification(FakeTokenizer())(features)
    assert batch["labels"].tolist() == [[1, 2, 1], [2, -100, -100]]
    tok = FakeTokenizer()
    tok.padding_side = "left"
    assert DataCollatorForTokenClassification(tok)(features)["labels"][1].tolist() == [-100, -100, 2]


def test_trainer_default_collator_follows_the_processing_class(tmp_path):
    args = make_args(tmp_path)
    assert Trainer(model=gpt(), args=args).data_collator is default_data_collator
    with_tokenizer = Trainer(model=gpt(), args=args, processing_class=CharTokenizer())
    assert isinstance(with_tokenizer.data_collator, DataCollatorWithPadding)
    mine = Trainer(model=gpt(), args=args, processing_class=CharTokenizer(), data_collator=LM)
    assert mine.data_collator is LM
