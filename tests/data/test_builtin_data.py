"""Built-in demo data: the char tokenizer, stdlib text, token blocks, synthetic classification."""

from __future__ import annotations

import string
import subprocess
import sys
import time

import pytest
import torch

from workbench.data.builtin import (
    BUILTIN_DATA,
    CharTokenizer,
    TokenBlockDataset,
    builtin_tokenizer,
    load_builtin_data,
    python_source_text,
)
from workbench.models import MLPClassifier

# ----------------------------------------------------------------------------- tokenizer


def test_char_tokenizer_vocabulary():
    tok = CharTokenizer()
    assert tok.vocab_size == 2 + 2 + (126 - 32 + 1) == 99
    assert tok.pad_token_id == 0
    assert tok.encode("\n\t ~") == [2, 3, 4, 98]
    assert tok.tokens[:2] == ("<pad>", "<unk>")


def test_char_tokenizer_round_trip():
    tok = CharTokenizer()
    text = string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "") + "def f(x):\n\treturn x"
    ids = tok.encode(text)
    assert all(2 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok("ab") == {"input_ids": tok.encode("ab")}
    assert tok(["a", "bc"]) == {"input_ids": [tok.encode("a"), tok.encode("bc")]}


def test_char_tokenizer_unknown_and_pad():
    tok = CharTokenizer()
    assert tok.encode("é\r€\x7f") == [1, 1, 1, 1]
    assert tok.decode([0, 0] + tok.encode("hi") + [0]) == "hi"
    # Unknown and out-of-vocabulary ids (an untrained 128-way model may sample them) still decode.
    assert tok.decode([1, 120]) == "\ufffd\ufffd"


def test_char_tokenizer_is_fast_on_large_text():
    tok = CharTokenizer()
    text = "x = 1  # é\n" * 200_000
    start = time.perf_counter()
    ids = tok.encode_array(text)
    assert time.perf_counter() - start < 1.0
    assert ids.shape == (len(text),)


# ----------------------------------------------------------------------------- stdlib text


def test_python_source_text_is_deterministic_and_nontrivial():
    text = python_source_text(300_000)
    assert len(text) == 300_000
    assert text.startswith("\n# file: ")
    assert text.count("\n# file: ") >= 2
    assert "def " in text and "import " in text
    # The cache is per process; a fresh read (cache cleared) must give the same text.
    python_source_text.cache_clear()
    assert python_source_text(300_000) == text
    # A shorter text is a prefix of a longer one.
    assert python_source_text(1000) == text[:1000]


def test_python_source_text_only_top_level_modules():
    text = python_source_text()
    names = [line[len("# file: "):] for line in text.splitlines() if line.startswith("# file: ")]
    assert names == sorted(names)
    assert all(name.endswith(".py") and "/" not in name for name in names)
    assert not any(name.startswith(("test_", "_sysconfigdata")) for name in names)


def test_data_module_does_not_import_datasets():
    code = "import sys, workbench.data.builtin; print('datasets' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# ----------------------------------------------------------------------------- datasets


def test_token_block_dataset():
    ids = torch.arange(10)
    ds = TokenBlockDataset(ids, block_size=3)
    assert len(ds) == 3
    item = ds[1]
    assert torch.equal(item["input_ids"], torch.tensor([3, 4, 5]))
    assert torch.equal(item["labels"], item["input_ids"])
    assert item["input_ids"].dtype == torch.long
    assert torch.equal(ds[-1]["input_ids"], torch.tensor([6, 7, 8]))
    with pytest.raises(IndexError):
        ds[3]
    # Items are copies: editing one (as a masking collator might) leaves the data intact.
    item["labels"][0] = -100
    item["input_ids"][1] = 0
    assert torch.equal(ds[1]["labels"], torch.tensor([3, 4, 5]))


def test_load_python_source_lengths_and_split():
    train, eval_ = load_builtin_data("python-source", block_size=64, max_chars=200_000, eval_fraction=0.1)
    assert len(train) == 180_000 // 64
    assert len(eval_) == 20_000 // 64
    item = train[0]
    assert item["input_ids"].shape == (64,)
    assert torch.equal(item["labels"], item["input_ids"])
    # The split is contiguous: train text first, eval text after it, no overlap.
    tok = builtin_tokenizer("python-source")
    text = python_source_text(200_000)
    assert tok.decode(train[0]["input_ids"]) == text[:64]
    assert tok.decode(eval_[0]["input_ids"]) == text[180_000:180_064]
    assert torch.equal(torch.cat([eval_[i]["input_ids"] for i in range(len(eval_))]),
                       torch.tensor(tok.encode(text[180_000:180_000 + len(eval_) * 64])))


def test_load_python_source_default_is_fast_after_first_call():
    load_builtin_data("python-source")
    start = time.perf_counter()
    train, eval_ = load_builtin_data("python-source")
    assert time.perf_counter() - start < 0.5
    assert len(train) == 1_900_000 // 128
    assert len(eval_) == 100_000 // 128
    assert max(int(train[i]["input_ids"].max()) for i in range(0, len(train), 500)) < 99


def test_load_python_source_too_small_raises():
    with pytest.raises(ValueError, match="eval blocks"):
        load_builtin_data("python-source", max_chars=1000, block_size=128)
    with pytest.raises(ValueError, match="eval_fraction"):
        load_builtin_data("python-source", eval_fraction=0.0)


def test_random_classification_shapes_and_determinism():
    train, eval_ = load_builtin_data("random-classification", n_train=100, n_eval=20, in_features=6,
                                     num_classes=3, seed=5)
    assert len(train) == 100 and len(eval_) == 20
    item = train[0]
    assert item["x"].shape == (6,) and item["x"].dtype == torch.float32
    assert item["labels"].shape == () and item["labels"].dtype == torch.long
    again, _ = load_builtin_data("random-classification", n_train=100, n_eval=20, in_features=6,
                                 num_classes=3, seed=5)
    assert torch.equal(again[3]["x"], train[3]["x"])
    other, _ = load_builtin_data("random-classification", n_train=100, n_eval=20, in_features=6,
                                 num_classes=3, seed=6)
    assert not torch.equal(other[3]["x"], train[3]["x"])
    labels = torch.stack([train[i]["labels"] for i in range(len(train))])
    assert set(labels.tolist()) == {0, 1, 2}
    assert builtin_tokenizer("random-classification") is None


def test_random_classification_is_learnable():
    train, eval_ = load_builtin_data("random-classification")
    torch.manual_seed(0)
    model = MLPClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(train, batch_size=64, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    model.train()
    for _ in range(10):  # 10 epochs x 32 batches = 320 steps
        for batch in loader:
            loss = model(**batch)["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    batch = next(iter(torch.utils.data.DataLoader(eval_, batch_size=len(eval_))))
    with torch.no_grad():
        accuracy = (model(batch["x"])["logits"].argmax(-1) == batch["labels"]).float().mean().item()
    assert accuracy > 0.8


def test_load_builtin_data_errors():
    assert set(BUILTIN_DATA) == {"python-source", "random-classification"}
    with pytest.raises(ValueError, match="python-source, random-classification"):
        load_builtin_data("imagenet")
    with pytest.raises(ValueError) as err:
        load_builtin_data("random-classification", n_examples=5)
    assert "n_examples" in str(err.value) and "n_train" in str(err.value) and "num_classes" in str(err.value)
    with pytest.raises(ValueError, match="n_train"):
        load_builtin_data("python-source", n_train=5)
