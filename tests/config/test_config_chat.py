"""``[data] format`` and ``completion_only_loss``: their checks (one located line each), and a
Trainer built from such a config on a tiny Llama: the collator pads labels with -100, and
the ``num_items_in_batch`` the model's loss divides by is the number of answer tokens.
"""

from __future__ import annotations

import pytest
import torch

from workbench.config.build import build_trainer
from workbench.config.loader import load_config
from workbench.data.collators import DataCollatorForSeq2Seq

from support.configs import HEAD, error_of, write
from support.finetune import build_workspace, chat_rows

DATA_TRAIN = '[model]\nbuiltin = "tiny-gpt"\n[data]\ntrain = { path = "json", data_files = "t.jsonl" }\n'  # 4 lines


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("chat-config"), rows=16)


# -- the checks ---------------------------------------------------------------------------------


def test_format_and_completion_only_loss_are_read(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    data = load_config(write(tmp_path, DATA_TRAIN + 'format = "prompt-completion"\nmax_length = 64\n'
                                                    'packing = true\ncompletion_only_loss = false\n')).data
    assert (data.format, data.completion_only_loss, data.max_length, data.packing) == (
        "prompt-completion", False, 64, True)
    data = load_config(write(tmp_path, DATA_TRAIN + 'format = "messages"\n')).data
    assert (data.format, data.completion_only_loss, data.text_column) == ("messages", True, None)
    assert load_config(write(tmp_path, DATA_TRAIN)).data.format is None


@pytest.mark.parametrize("lines, message", [
    ('format = "mesages"\n', ("5: data.format: unknown format 'mesages' (did you mean messages?); choices: messages, "
                             "prompt-completion")),
    ('format = "prompt_completion"\n', ("5: data.format: unknown format 'prompt_completion' (did you mean "
                                       "prompt-completion?); choices: messages, prompt-completion")),
    ('format = "sharegpt"\n', "5: data.format: unknown format 'sharegpt'; choices: messages, prompt-completion"),
    ('format = 1\n', "5: data.format: expected a non-empty string, got 1 (an integer)"),
    ('text_column = "text"\nformat = "messages"\n', ("6: data.format: cannot be combined with text_column: format "
                                                    "reads chat or prompt/completion rows, text_column tokenizes "
                                                    "plain text; set one of them")),
    ('format = "messages"\ncompletion_only_loss = "yes"\n', ('6: data.completion_only_loss: expected true or false, '
                                                            'got "yes" (a string)')),
    ('format = "messages"\ncompletion_only_loss = 1\n', ("6: data.completion_only_loss: expected true or false, "
                                                        "got 1 (an integer)")),
    ('completion_only_loss = true\n', ('5: data.completion_only_loss: applies to chat data: set format = "messages" '
                                      'or "prompt-completion"')),
    ('format = "messages"\npacking = true\n', "6: data.packing: needs max_length (the block size in tokens)"),
])
def test_format_errors_are_one_located_line(tmp_path, lines, message):
    (tmp_path / "t.jsonl").write_text('{"messages": []}\n')
    p = write(tmp_path, DATA_TRAIN + lines)
    assert error_of(p) == f"{p}:{message}"


def test_format_cannot_go_with_builtin_data(tmp_path):
    p = write(tmp_path, HEAD + 'format = "messages"\n')
    assert error_of(p) == f"{p}:6: data.format: cannot be combined with builtin (builtin data sets come tokenized)"
    p = write(tmp_path, HEAD + 'completion_only_loss = false\n')
    assert error_of(p).startswith(f"{p}:6: data.completion_only_loss: cannot be combined with builtin")


# -- the Trainer ------------------------------------------------------------------------------


def chat_config(folder, ws, training: str = "") -> object:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cfg.toml"
    path.write_text(f"""\
[model]
pretrained = "{ws.model}"
[data]
train = {{ path = "{ws.chat}" }}
format = "messages"
[training]
output_dir = "out"
per_device_train_batch_size = 4
gradient_accumulation_steps = 2
max_steps = 2
train_sampling_strategy = "sequential"
learning_rate = 1e-3
save_strategy = "no"
report_to = "none"
disable_tqdm = true
{training}
""")
    return load_config(path)


def test_the_collator_pads_chat_labels_with_minus_100_and_keeps_the_masks(tmp_path, ws):
    trainer = build_trainer(chat_config(tmp_path, ws), progress=False)
    assert isinstance(trainer.data_collator, DataCollatorForSeq2Seq)
    assert trainer.processing_class is not None and trainer.processing_class.chat_template
    rows = [trainer.train_dataset[i] for i in range(4)]
    assert len({len(r["input_ids"]) for r in rows}) > 1  # ragged: there is padding to check
    batch = trainer.data_collator(rows)
    for k, row in enumerate(rows):
        n = len(row["input_ids"])
        assert batch["labels"][k, :n].tolist() == row["labels"]  # the answer masks survive collation
        assert (batch["labels"][k, n:] == -100).all() and (batch["attention_mask"][k, n:] == 0).all()
        assert batch["input_ids"][k, :n].tolist() == row["input_ids"]


def test_num_items_in_batch_counts_the_answer_tokens_of_the_step(tmp_path, ws):
    trainer = build_trainer(chat_config(tmp_path, ws), progress=False)
    tok = trainer.processing_class
    seen: list[dict] = []

    def record(module, args, kwargs, output):
        seen.append({"items": int(kwargs["num_items_in_batch"]), "ids": kwargs["input_ids"].clone(),
                     "mask": kwargs["attention_mask"].clone(), "labels": kwargs["labels"].clone(),
                     "logits": output.logits.detach().clone(), "loss": float(output.loss.detach())})

    trainer.model.register_forward_hook(record, with_kwargs=True)
    trainer.train()
    assert len(seen) == 4  # 2 steps of 2 micro-batches

    # Independently: the answers of the rows, in order (sequential sampling), tokenized apart.
    rows = chat_rows(16)
    answers = [sum(len(tok(m["content"] + "<|end|>", add_special_tokens=False)["input_ids"])
                   for m in r["messages"] if m["role"] == "assistant") for r in rows]
    for step in range(2):
        micro = seen[2 * step: 2 * step + 2]
        first = 8 * step
        expected = sum(answers[first:first + 8])
        assert [m["items"] for m in micro] == [expected, expected]
        for k, m in enumerate(micro):
            for j in range(4):  # the rows are the rows of the file, rendered by the template
                text = tok.apply_chat_template(rows[first + 4 * k + j]["messages"], tokenize=False)
                n = int(m["mask"][j].sum())
                assert tok.decode(m["ids"][j, :n].tolist()) == text
            # The model's loss is the sum over the answer targets divided by the step's count.
            logits, targets = m["logits"][:, :-1].float(), m["labels"][:, 1:]
            total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                      ignore_index=-100, reduction="sum")
            assert m["loss"] == pytest.approx(float(total) / expected, rel=1e-4)
