"""Build, offline, what the scripts next to this file load: tokenizers trained here on the
Python standard library's source, three tiny models saved with ``save_pretrained`` (a GPT-2
causal LM, a BERT masked LM, a BERT sentence classifier) and local data files.

    python examples/hf_scripts/make_assets.py ASSETS_DIR

Nothing is downloaded: the models are built from configs, the tokenizers are trained with the
``tokenizers`` package, and the text is read from the interpreter's own library.
"""

from __future__ import annotations

import csv
import random
import sys
import sysconfig
from pathlib import Path

MODULES = ("json", "csv", "argparse", "dataclasses", "textwrap", "string", "shlex", "fractions")


def source_lines(limit: int = 4000) -> list[str]:
    """Non-empty lines of a few standard-library modules, in a fixed order."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for name in MODULES:
        path = lib / f"{name}.py" if (lib / f"{name}.py").exists() else lib / name / "__init__.py"
        lines += [line.rstrip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines[:limit]


def train_tokenizer(lines: list[str], kind: str, vocab_size: int = 400):
    """A fast tokenizer trained on ``lines``: byte-level BPE for GPT-2, WordPiece for BERT."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "gpt2":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(lines, trainer)
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                       unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(lines, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=64)


def build(out: Path) -> None:
    """Write ``out/{gpt2,bert-mlm,bert-cls}`` (model + tokenizer), ``out/text/*.txt`` and
    ``out/cls/*.csv``."""
    import torch
    from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification, GPT2Config,
                              GPT2LMHeadModel)

    lines = source_lines()
    gpt_tok, bert_tok = train_tokenizer(lines, "gpt2"), train_tokenizer(lines, "bert")
    torch.manual_seed(0)
    gpt = GPT2LMHeadModel(GPT2Config(vocab_size=len(gpt_tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=gpt_tok.bos_token_id, eos_token_id=gpt_tok.eos_token_id))
    bert = dict(vocab_size=len(bert_tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=64, pad_token_id=bert_tok.pad_token_id)
    mlm = BertForMaskedLM(BertConfig(**bert))
    classifier = BertForSequenceClassification(BertConfig(**bert, num_labels=2))
    for name, model, tok in (("gpt2", gpt, gpt_tok), ("bert-mlm", mlm, bert_tok), ("bert-cls", classifier, bert_tok)):
        model.save_pretrained(out / name)
        tok.save_pretrained(out / name)

    (out / "text").mkdir(parents=True, exist_ok=True)
    cut = len(lines) * 9 // 10
    (out / "text" / "train.txt").write_text("\n".join(lines[:cut]) + "\n", encoding="utf-8")
    (out / "text" / "validation.txt").write_text("\n".join(lines[cut:]) + "\n", encoding="utf-8")

    # Sentence classification: is a source line a comment? Balanced, shuffled with a fixed seed.
    comments = [line.strip() for line in lines if line.strip().startswith("#") and len(line.strip()) > 3]
    code = [line.strip() for line in lines if not line.strip().startswith("#")][: len(comments)]
    rows = [(text, 1) for text in comments] + [(text, 0) for text in code]
    random.Random(0).shuffle(rows)
    (out / "cls").mkdir(parents=True, exist_ok=True)
    splits = {"train": rows[:-140], "validation": rows[-140:-70], "test": rows[-70:]}
    for split, part in splits.items():
        with open(out / "cls" / f"{split}.csv", "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence", "label"])
            writer.writerows(part)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/hf_scripts/make_assets.py ASSETS_DIR")
    build(Path(sys.argv[1]))
    print(f"assets written to {sys.argv[1]}")
