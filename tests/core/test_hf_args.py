"""HF users' arguments run unchanged (issue 23, items 4 and 5; 7 and 8 are in test_hf_args_training.py).

Side by side with transformers' own TrainingArguments, HfArgumentParser, get_scheduler and
Trainer: the flag matrix parses each command line into both classes and compares every
field they share; then the members and defaults scripts rely on.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import shlex

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="these tests compare with transformers (the test extra)")

from workbench import Trainer, TrainingArguments  # noqa: E402
from workbench.core.args.training import ArgumentError  # noqa: E402

from support import make_args, tiny_bert, token_rows

HF = transformers.TrainingArguments
Parser = transformers.HfArgumentParser


# -- item 4: the flag matrix ----------------------------------------------------------------

# Each a command line a transformers 5.x script accepts (after --output_dir), on a CPU.
FLAG_SETS = [
    "",
    "--do_train",
    "--do_train --do_eval --do_predict",
    "--gradient_checkpointing",
    "--gradient_checkpointing false",
    "--activation_checkpointing",
    "--gradient_checkpointing --gradient_checkpointing_kwargs '{\"use_reentrant\": false}'",
    "--fp16",
    "--fp16_full_eval",
    "--bf16 --use_cpu",
    "--bf16_full_eval --use_cpu",
    "--tf32 false",
    "--report_to none",
    "--report_to tensorboard",
    "--label_names start_positions end_positions",
    "--include_for_metrics inputs loss",
    "--lr_scheduler_kwargs '{\"min_lr\": 1e-6}' --lr_scheduler_type cosine_with_min_lr",
    "--lr_scheduler_type cosine_with_restarts --lr_scheduler_kwargs '{\"num_cycles\": 3}'",
    "--lr_scheduler_type warmup_stable_decay --lr_scheduler_kwargs '{\"num_decay_steps\": \"20\", \"warmup_type\": \"cosine\"}'",
    "--lr_scheduler_type polynomial --lr_scheduler_kwargs '{\"power\": \"2.5\", \"lr_end\": \"1e-7\"}'",
    "--lr_scheduler_type cosine_warmup_with_min_lr --lr_scheduler_kwargs '{\"min_lr_rate\": 0.1}'",
    "--lr_scheduler_type inverse_sqrt --warmup_steps 10",
    "--lr_scheduler_type constant_with_warmup --warmup_steps 0.05",
    "--lr_scheduler_type reduce_lr_on_plateau --eval_strategy epoch",
    "--lr_scheduler_type constant",
    "--warmup_steps 0.1",
    "--warmup_steps 50",
    "--eval_strategy steps --eval_steps 0.25",
    "--eval_strategy steps",
    "--eval_strategy epoch --eval_delay 2",
    "--logging_steps 0.05 --logging_first_step",
    "--logging_strategy epoch --logging_steps 10",
    "--logging_strategy no",
    "--save_strategy epoch --save_total_limit 2 --save_only_model",
    "--save_strategy best --eval_strategy steps --eval_steps 10 --metric_for_best_model accuracy",
    "--load_best_model_at_end --eval_strategy epoch --save_strategy epoch",
    "--load_best_model_at_end --eval_strategy steps --eval_steps 0.25 --save_steps 0.5",
    "--greater_is_better false --metric_for_best_model f1 --eval_strategy epoch --save_strategy epoch",
    "--save_steps 200 --save_on_each_node",
    "--optim adamw_torch",
    "--optim sgd --optim_args 'momentum=0.9,nesterov=true'",
    "--optim adagrad",
    "--optim rmsprop --optim_args 'alpha=0.9'",
    "--optim adafactor",
    "--learning_rate 3e-4 --weight_decay 0.01 --adam_beta1 0.8 --adam_beta2 0.95 --adam_epsilon 1e-6",
    "--max_grad_norm 0.5 --label_smoothing_factor 0.1",
    "--max_steps 100 --num_train_epochs 2.5",
    "--per_device_train_batch_size 16 --per_device_eval_batch_size 32 --gradient_accumulation_steps 4",
    "--no_remove_unused_columns --no_dataloader_pin_memory",
    "--no-log-on-each-node --no-logging-nan-inf-filter",
    "--no_average_tokens_across_devices --no_skip_memory_metrics --no_eval_do_concat_batches",
    "--remove_unused_columns false --dataloader_drop_last",
    "--dataloader_num_workers 2 --dataloader_prefetch_factor 4 --dataloader_persistent_workers "
    "--dataloader_multiprocessing_context spawn",
    "--no_dataloader_in_order",
    "--train_sampling_strategy group_by_length --length_column_name n_tokens",
    "--train_sampling_strategy sequential",
    "--seed 7 --data_seed 3 --full_determinism",
    "--log_level info --log_level_replica error",
    "--disable_tqdm true",
    "--run_name my-run --project my-project",
    "--include_num_input_tokens_seen",
    "--include_num_input_tokens_seen false",
    "--neftune_noise_alpha 5 --torch_empty_cache_steps 10",
    "--auto_find_batch_size --ignore_data_skip --restore_callback_states_from_checkpoint",
    "--enable_jit_checkpoint --eval_use_gather_object --batch_eval_metrics",
    "--eval_accumulation_steps 4 --prediction_loss_only --eval_on_start --eval_strategy steps",
    "--ddp_find_unused_parameters false --ddp_bucket_cap_mb 25 --ddp_timeout 600",
    "--ddp_broadcast_buffers true --ddp_static_graph true",
    "--accelerator_config '{\"split_batches\": true, \"even_batches\": \"false\"}'",
    "--accelerator_config {acc_file}",
    "--torch_compile",
    "--torch_compile_mode reduce-overhead",
    "--hub_strategy checkpoint",
    "--resume_from_checkpoint {tmp}/checkpoint-10",
    "--use_cpu",
    "--fsdp 'full_shard auto_wrap'",
]

# Fields that differ on purpose, with the flag that makes them differ and why.
DIFFER_ON_PURPOSE = {
    "fsdp": ("--fsdp", "workbench keeps the option list (['full_shard', 'auto_wrap']); transformers 5.x folds the "
                       "options into fsdp_config and sets fsdp=True"),
    "fsdp_config": ("--fsdp", "the same folding: transformers adds reshard_after_forward and its xla defaults"),
}

# Command lines transformers accepts and workbench refuses at argument time, with the field
# its one-line error names (what workbench cannot serve here).
REFUSED = [
    ("--push_to_hub", "push_to_hub"),
    ("--hub_model_id me/model", "hub_model_id"),
    ("--use_liger_kernel", "use_liger_kernel"),
    ("--use_cache", "use_cache"),
    ("--debug underflow_overflow", "debug"),
    ("--report_to wandb", "report_to"),
    ("--optim adamw_bnb_8bit", "optim"),
    ("--optim galore_adamw --optim_target_modules all-linear", "optim_target_modules"),
    ("--lr_scheduler_type greedy --eval_strategy steps", "lr_scheduler_type"),
    ("--accelerator_config '{\"use_seedable_sampler\": false}'", "accelerator_config"),
]

# Values argparse itself refuses: exit 2 with the same one-line message under both.
BAD_VALUES = [
    "--learning_rate abc",
    "--max_steps 1.5",
    "--per_device_train_batch_size eight",
    "--optim adamw_foo",
    "--lr_scheduler_type bogus",
    "--eval_strategy sometimes",
    "--save_strategy always",
    "--hub_strategy never",
    "--do_train maybe",
    "--fp16 perhaps",
    "--gradient_checkpointing sometimes",
    "--log_level loud",
    "--train_sampling_strategy by_length",
    "--dataloader_multiprocessing_context thread",
    "--label_names",
    "--warmup_steps ten",
]


def _argv(flags: str, tmp_path) -> list[str]:
    acc_file = tmp_path / "accelerator.json"
    acc_file.write_text(json.dumps({"dispatch_batches": False, "non_blocking": True}))
    flags = flags.replace("{tmp}", str(tmp_path)).replace("{acc_file}", str(acc_file))
    return ["--output_dir", str(tmp_path / "out"), *shlex.split(flags)]


def _parse(cls, argv):
    (args,) = Parser(cls).parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    return args


def _normal(value):
    """A value as compared: an enum as ("enum", value) so a plain string never passes for
    one, config objects as dicts, lists element by element."""
    if isinstance(value, enum.Enum):
        return ("enum", value.value)
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if dataclasses.is_dataclass(value) and hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return ("number", float(value))
    return value


def shared_fields() -> list[str]:
    ours = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f.name for f in dataclasses.fields(HF) if f.name in ours]


@pytest.mark.parametrize("flags", FLAG_SETS)
def test_flag_matrix_parses_into_the_same_values_as_transformers(flags, tmp_path):
    argv = _argv(flags, tmp_path)
    theirs, ours = _parse(HF, argv), _parse(TrainingArguments, argv)
    assert isinstance(ours, TrainingArguments)
    differ = {name for name, (flag, _) in DIFFER_ON_PURPOSE.items() if flag in flags}
    mismatched = {name: (getattr(theirs, name), getattr(ours, name)) for name in shared_fields()
                  if name not in differ and _normal(getattr(theirs, name)) != _normal(getattr(ours, name))}
    assert mismatched == {}


def test_the_flag_matrix_is_large_and_compares_every_shared_field():
    assert len(FLAG_SETS) >= 60
    assert len(shared_fields()) == len(dataclasses.fields(HF))  # every field of HF's class is compared
    assert len(DIFFER_ON_PURPOSE) <= 3


def test_fsdp_keeps_the_options_transformers_folds_into_its_config(tmp_path):
    argv = _argv("--fsdp 'full_shard auto_wrap'", tmp_path)
    ours, theirs = _parse(TrainingArguments, argv), _parse(HF, argv)
    assert ours.fsdp == ["full_shard", "auto_wrap"] and ours.fsdp_config is None
    assert theirs.fsdp is True and theirs.fsdp_config["reshard_after_forward"] is True


@pytest.mark.parametrize("flags, field", REFUSED)
def test_what_workbench_cannot_serve_is_one_line_naming_the_field(flags, field, tmp_path):
    argv = _argv(flags, tmp_path)
    _parse(HF, argv)  # transformers accepts it at argument time
    with pytest.raises(ArgumentError) as info:
        _parse(TrainingArguments, argv)
    assert info.value.key == field and "\n" not in str(info.value)


@pytest.mark.parametrize("flags", BAD_VALUES)
def test_a_bad_value_exits_2_with_the_argparse_message_transformers_gives(flags, tmp_path, capsys):
    argv = _argv(flags, tmp_path)
    lines = []
    for cls in (HF, TrainingArguments):
        with pytest.raises(SystemExit) as info:
            Parser(cls, prog="train.py").parse_args_into_dataclasses(args=argv, look_for_args_file=False)
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("train.py: error: argument --")
        lines.append(err[-1])
    assert lines[0] == lines[1]


@dataclasses.dataclass
class ModelArgs:
    model_name_or_path: str = "local-model"
    use_fast_tokenizer: bool = True


@dataclasses.dataclass
class DataArgs:
    train_file: str | None = None
    max_seq_length: int = 128


def test_a_script_parser_over_three_dataclasses_from_argv_json_and_dict(tmp_path):
    argv = ["--model_name_or_path", "m", "--no_use_fast_tokenizer", "--train_file", "t.txt", "--output_dir",
            str(tmp_path), "--do_train", "--gradient_checkpointing", "--report_to", "none", "--warmup_steps", "0.1",
            "--lr_scheduler_kwargs", '{"num_cycles": 2}', "--lr_scheduler_type", "cosine"]
    model_args, data_args, ours = Parser((ModelArgs, DataArgs, TrainingArguments)).parse_args_into_dataclasses(
        args=argv, look_for_args_file=False)
    assert model_args.use_fast_tokenizer is False and data_args.train_file == "t.txt"
    assert ours.do_train and ours.gradient_checkpointing is True and ours.lr_scheduler_kwargs == {"num_cycles": 2}
    values = {"model_name_or_path": "m", "train_file": "t.txt", "output_dir": str(tmp_path), "do_train": True,
              "gradient_checkpointing": True, "eval_strategy": "steps", "eval_steps": 0.5,
              "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
              "label_names": ["labels"], "debug": "", "accelerator_config": {"even_batches": False}}
    path = tmp_path / "args.json"
    path.write_text(json.dumps(values))
    for parsed in (Parser((ModelArgs, DataArgs, TrainingArguments)).parse_json_file(str(path)),
                   Parser((ModelArgs, DataArgs, TrainingArguments)).parse_dict(values)):
        theirs = Parser((ModelArgs, DataArgs, HF)).parse_dict(values)[2]
        assert {n: _normal(getattr(parsed[2], n)) for n in shared_fields()} == \
               {n: _normal(getattr(theirs, n)) for n in shared_fields()}


def test_fp16_on_a_cpu_is_accepted_as_transformers_accepts_it_and_trains_in_float32(tmp_path, caplog):
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("this machine has an fp16 device")
    theirs, ours = _train_pair(tmp_path, fp16=True, max_steps=3)
    assert [e["loss"] for e in ours.state.log_history if "loss" in e] == \
           [e["loss"] for e in theirs.state.log_history if "loss" in e]
    assert "fp16: this run is on the CPU" in caplog.text


BASE = dict(per_device_train_batch_size=4, learning_rate=1e-2, report_to="none", save_strategy="no",
            logging_steps=1, use_cpu=True, seed=0, train_sampling_strategy="sequential", disable_tqdm=True)


def _train_pair(tmp_path, **options):
    """The same run by transformers' Trainer and workbench's (with HF's arguments)."""
    kwargs = {**BASE, **options}
    evals = token_rows(12) if kwargs.get("eval_strategy", "no") != "no" else None
    theirs = transformers.Trainer(model=tiny_bert(), args=HF(str(tmp_path / "hf"), **kwargs), train_dataset=token_rows(),
                                  eval_dataset=evals)
    theirs.train()
    ours = Trainer(model=tiny_bert(), args=HF(str(tmp_path / "wb"), **kwargs), train_dataset=token_rows(), eval_dataset=evals)
    ours.train()
    return theirs, ours


# -- item 5: members and defaults -----------------------------------------------------------

ENUM_FIELDS = ("lr_scheduler_type", "optim", "eval_strategy", "save_strategy", "logging_strategy", "hub_strategy")


def test_defaults_after_post_init_are_transformers_own(tmp_path):
    theirs, ours = HF("out"), TrainingArguments("out")
    for name in ("fsdp", "debug", "lr_scheduler_kwargs", "gradient_checkpointing", "activation_checkpointing",
                 "run_name", "report_to", "do_eval", "torch_compile_backend", "dataloader_pin_memory"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.fsdp is None and ours.debug == [] and ours.run_name is None and ours.gradient_checkpointing is False
    assert ours.accelerator_config.to_dict() == theirs.accelerator_config.to_dict()
    assert ours.accelerator_config.split_batches is False and dict(ours.accelerator_config)["even_batches"] is True
    for name in ENUM_FIELDS:
        value, hf_value = getattr(ours, name), getattr(theirs, name)
        assert isinstance(value, enum.Enum) and isinstance(value, str) and value.value == hf_value.value
        assert value == hf_value.value and value == hf_value and f"{value}" == hf_value.value  # as plain strings


def test_enum_fields_write_and_compare_as_plain_strings(tmp_path):
    import tomli_w

    args = TrainingArguments(str(tmp_path), lr_scheduler_type="cosine", optim="sgd", eval_strategy="epoch")
    data = json.loads(args.to_json_string())
    assert data["lr_scheduler_type"] == "cosine" and data["optim"] == "sgd" and data["eval_strategy"] == "epoch"
    assert json.loads(json.dumps({"optim": args.optim})) == {"optim": "sgd"}
    assert tomli_w.dumps({"optim": args.optim}) == 'optim = "sgd"\n'
    assert f"{args.optim!r}" == "'sgd'" and str(args.eval_strategy) == "epoch"
    assert data["accelerator_config"] == HF("o").accelerator_config.to_dict()
    assert TrainingArguments(**data).to_dict() == args.to_dict()  # training_args.json rebuilds the arguments
    assert dataclasses.replace(args, activation_checkpointing=True).gradient_checkpointing is True


def test_a_saved_checkpoint_holds_plain_strings_and_resumes_without_warnings(tmp_path, caplog):
    from workbench.data.builtin import load_builtin_data
    from workbench.models import MLPClassifier

    train, _ = load_builtin_data("random-classification", n_train=32)
    options = dict(max_steps=4, save_strategy="steps", save_steps=2, lr_scheduler_type="cosine", optim="adagrad")
    Trainer(MLPClassifier(), make_args(tmp_path, **options), train_dataset=train).train()
    saved = json.loads((tmp_path / "checkpoint-2" / "training_args.json").read_text())
    assert saved["lr_scheduler_type"] == "cosine" and saved["optim"] == "adagrad"
    json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    with caplog.at_level(logging.WARNING, logger="workbench"):
        resumed = Trainer(MLPClassifier(), make_args(tmp_path, **options), train_dataset=train)
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert "in its training_args.json" not in caplog.text  # the same arguments compare equal


def test_a_config_file_round_trips_enum_fields_as_strings(tmp_path):
    from workbench.config.loader import dump_config, load_config

    path = tmp_path / "run.toml"
    path.write_text('[model]\nbuiltin = "mlp"\n[data]\nbuiltin = "random-classification"\n[training]\n'
                    'lr_scheduler_type = "warmup_stable_decay"\nlr_scheduler_kwargs = { num_decay_steps = 5 }\n'
                    'optim = "rmsprop"\neval_strategy = "steps"\naccelerator_config = { even_batches = false }\n')
    config = load_config(path)
    assert config.training.lr_scheduler_type == "warmup_stable_decay" and isinstance(config.training.optim, enum.Enum)
    assert config.training.accelerator_config.even_batches is False
    text = dump_config(config)
    assert 'lr_scheduler_type = "warmup_stable_decay"' in text and 'optim = "rmsprop"' in text
    (tmp_path / "again.toml").write_text(text)
    assert load_config(tmp_path / "again.toml").training.to_dict() == config.training.to_dict()


def test_process_members_match_transformers_in_one_process():
    theirs, ours = HF("out", log_level="info", log_level_replica="error"), TrainingArguments(
        "out", log_level="info", log_level_replica="error")
    for name in ("world_size", "process_index", "local_process_index", "should_log", "should_save",
                 "place_model_on_device"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.parallel_mode.value == theirs.parallel_mode.value == "not_parallel"
    assert ours.get_process_log_level() == theirs.get_process_log_level() == logging.INFO
    assert TrainingArguments("out").get_process_log_level() == HF("out").get_process_log_level()
    for local in (True, False):
        with ours.main_process_first(local=local, desc="dataset map"):
            ran = True
        assert ran


SETTERS = [
    ("set_training", dict(learning_rate=1e-4, batch_size=16, weight_decay=0.1, num_epochs=2, max_steps=50,
                          gradient_accumulation_steps=2, seed=3, activation_checkpointing=True)),
    ("set_evaluate", dict(strategy="steps", steps=20, batch_size=4, accumulation_steps=2, delay=1, loss_only=True)),
    ("set_testing", dict(batch_size=32, loss_only=True)),
    ("set_save", dict(strategy="epoch", steps=10, total_limit=3, on_each_node=True)),
    ("set_logging", dict(strategy="steps", steps=5, report_to=["tensorboard"], level="info", first_step=True,
                         nan_inf_filter=True, on_each_node=False, replica_level="error")),
    ("set_optimizer", dict(name="rmsprop", learning_rate=2e-4, weight_decay=0.01, beta1=0.8, beta2=0.9,
                           epsilon=1e-6, args="alpha=0.9")),
    ("set_lr_scheduler", dict(name="cosine_with_restarts", num_epochs=4, max_steps=80, warmup_steps=0.1)),
    ("set_dataloader", dict(train_batch_size=4, eval_batch_size=2, drop_last=True, num_workers=2, pin_memory=False,
                            persistent_workers=True, prefetch_factor=3, multiprocessing_context="spawn",
                            in_order=False, auto_find_batch_size=True, ignore_data_skip=True, sampler_seed=5)),
]


@pytest.mark.parametrize("method, kwargs", SETTERS)
def test_set_helpers_set_what_transformers_sets(method, kwargs):
    theirs, ours = HF("out"), TrainingArguments("out")
    assert getattr(ours, method)(**kwargs) is ours
    getattr(theirs, method)(**kwargs)
    assert {n: _normal(getattr(ours, n)) for n in shared_fields()} == \
           {n: _normal(getattr(theirs, n)) for n in shared_fields()}


def test_set_helpers_refuse_the_hub_and_unserved_optimizers_in_one_line():
    with pytest.raises(ValueError, match="Hugging Face Hub") as info:
        TrainingArguments("out").set_push_to_hub("me/model")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="bitsandbytes"):
        TrainingArguments("out").set_optimizer(name="paged_adamw_8bit")
    with pytest.raises(ValueError, match="is not one of"):
        TrainingArguments("out").set_evaluate(strategy="sometimes")
