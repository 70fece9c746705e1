"""HF users' arguments train unchanged (issue 23, items 7 and 8): transformers' own
TrainingArguments given to workbench's Trainer train like workbench's, and the optimizers and
schedules users name match transformers' get_scheduler and optimizer choices step by step.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="these tests compare with transformers (the test extra)")

from workbench import Trainer, TrainingArguments  # noqa: E402
from workbench.core.args.training import ArgumentError  # noqa: E402
from workbench.core.edits import apply_edit  # noqa: E402
from workbench.train.optim import get_optimizer_cls_and_kwargs  # noqa: E402
from workbench.train.schedules import get_scheduler  # noqa: E402

from support import make_args, tiny_bert, token_rows
from test_hf_args import HF, _normal, _train_pair, shared_fields

# -- item 7: transformers' TrainingArguments given to workbench's Trainer --------------------


NON_DEFAULTS = dict(
    per_device_train_batch_size=4, per_device_eval_batch_size=6, gradient_accumulation_steps=2, learning_rate=3e-3,
    weight_decay=0.01, adam_beta1=0.85, adam_beta2=0.98, adam_epsilon=1e-7, max_grad_norm=0.5, max_steps=6,
    lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_steps=0.2,
    optim="adamw_torch", logging_strategy="steps", logging_steps=2, logging_first_step=True, eval_strategy="steps",
    eval_steps=3, save_strategy="steps", save_steps=3, save_total_limit=2, seed=5, data_seed=7,
    label_smoothing_factor=0.05, report_to="none", run_name="from-hf", disable_tqdm=True, use_cpu=True,
    dataloader_drop_last=True, train_sampling_strategy="sequential", include_for_metrics=["loss"],
    accelerator_config={"even_batches": False}, gradient_checkpointing=False, log_level="info",
    metric_for_best_model="loss", load_best_model_at_end=True, include_num_input_tokens_seen=True,
)


def test_workbench_trainer_takes_transformers_arguments_field_by_field_leaving_them_untouched(tmp_path):
    theirs = HF(str(tmp_path), **NON_DEFAULTS)
    before = copy.deepcopy({f.name: getattr(theirs, f.name) for f in dataclasses.fields(HF)})
    trainer = Trainer(model=tiny_bert(), args=theirs, train_dataset=token_rows(), eval_dataset=token_rows(12))
    ours = trainer.args
    assert type(ours) is TrainingArguments and ours is not theirs
    assert {n: _normal(getattr(ours, n)) for n in shared_fields()} == \
           {n: _normal(getattr(theirs, n)) for n in shared_fields()}
    assert ours.accelerator_config.even_batches is False and trainer.accelerator.dataloader_config.even_batches is False
    assert ours.lr_scheduler_kwargs is not theirs.lr_scheduler_kwargs  # copies, not the user's objects
    trainer.train()
    assert trainer.state.global_step == 6 and trainer.state.best_global_step is not None
    assert {n: _normal(getattr(theirs, n)) for n in before} == {n: _normal(v) for n, v in before.items()}
    assert isinstance(theirs.accelerator_config, transformers.trainer_pt_utils.AcceleratorConfig)


def test_a_run_with_transformers_arguments_matches_transformers_trainer(tmp_path):
    theirs, ours = _train_pair(tmp_path, max_steps=6, lr_scheduler_type="warmup_stable_decay", warmup_steps=2,
                               lr_scheduler_kwargs={"num_decay_steps": 3}, optim="rmsprop")
    assert [e["loss"] for e in ours.state.log_history if "loss" in e] == \
           [e["loss"] for e in theirs.state.log_history if "loss" in e]


def test_transformers_arguments_workbench_cannot_serve_are_one_line_naming_the_field(tmp_path):
    with pytest.raises(ArgumentError) as info:
        Trainer(model=tiny_bert(), args=HF(str(tmp_path), push_to_hub=True, hub_model_id="me/m"), train_dataset=token_rows())
    assert info.value.key == "push_to_hub" and "TrainingArguments given to workbench" in str(info.value)
    seq2seq = transformers.Seq2SeqTrainingArguments(str(tmp_path), predict_with_generate=True)
    with pytest.raises(ArgumentError) as info:
        Trainer(model=tiny_bert(), args=seq2seq, train_dataset=token_rows())
    assert info.value.key == "predict_with_generate" and "\n" not in str(info.value)
    # At their defaults the extra fields of HF's subclass are no obstacle.
    Trainer(model=tiny_bert(), args=transformers.Seq2SeqTrainingArguments(str(tmp_path)), train_dataset=token_rows())


# -- item 8: optimizers and schedules -------------------------------------------------------

SCHEDULE_CASES = [
    ("linear", {}), ("cosine", {"num_cycles": 1.5}), ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {"power": 2.0, "lr_end": 1e-5}), ("constant", {}), ("constant_with_warmup", {}),
    ("inverse_sqrt", {}), ("inverse_sqrt", {"timescale": 7}), ("cosine_with_min_lr", {"min_lr": 1e-4}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.2}), ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_warmup_with_min_lr", {"min_lr": 1e-3, "warmup_lr_rate": 0.05}),
    ("warmup_stable_decay", {"num_decay_steps": 10}),
    ("warmup_stable_decay", {"num_decay_steps": 8, "warmup_type": "cosine", "decay_type": "1-sqrt",
                             "min_lr_ratio": 0.1}),
    ("warmup_stable_decay", {"num_decay_steps": 8, "num_stable_steps": 5, "warmup_type": "1-sqrt",
                             "decay_type": "linear", "min_lr_ratio": 0.05}),
]


def _sgd(lr: float = 0.01) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


@pytest.mark.parametrize("warmup", [0, 5])
@pytest.mark.parametrize("name, kwargs", SCHEDULE_CASES)
def test_each_schedule_gives_transformers_rate_at_every_step(name, kwargs, warmup, recwarn):
    hf_opt, wb_opt = _sgd(), _sgd()
    theirs = transformers.get_scheduler(name, hf_opt, num_warmup_steps=warmup, num_training_steps=30,
                                        scheduler_specific_kwargs=dict(kwargs))
    ours = get_scheduler(name, wb_opt, num_warmup_steps=warmup, num_training_steps=30,
                         scheduler_specific_kwargs=dict(kwargs))
    for _ in range(36):  # past the end too
        assert ours.get_last_lr() == theirs.get_last_lr()
        hf_opt.step(), wb_opt.step(), theirs.step(), ours.step()


def test_reduce_lr_on_plateau_steps_on_metrics_as_transformers():
    hf_opt, wb_opt = _sgd(0.1), _sgd(0.1)
    kwargs = {"patience": 1, "factor": 0.5, "threshold": 0.0}
    theirs = transformers.get_scheduler("reduce_lr_on_plateau", hf_opt, scheduler_specific_kwargs=dict(kwargs))
    ours = get_scheduler("reduce_lr_on_plateau", wb_opt, scheduler_specific_kwargs=dict(kwargs))
    for metric in (1.0, 0.9, 0.9, 0.9, 0.95, 0.8, 0.8, 0.8):
        theirs.step(metric), ours.step(metric)
        assert wb_opt.param_groups[0]["lr"] == hf_opt.param_groups[0]["lr"]
    assert wb_opt.param_groups[0]["lr"] < 0.1


def test_reduce_lr_on_plateau_in_training_logs_transformers_rates(tmp_path):
    options = dict(max_steps=8, eval_strategy="steps", eval_steps=2, lr_scheduler_type="reduce_lr_on_plateau",
                   lr_scheduler_kwargs={"patience": 0, "factor": 0.5, "threshold": 0.5}, learning_rate=5e-2)
    theirs, ours = _train_pair(tmp_path, **options)

    def series(trainer, key):
        return [(e["step"], e[key]) for e in trainer.state.log_history if key in e]

    # The plateau decisions follow the evaluated loss; the two evaluation loops sum the same
    # per-sample losses in another float32 order (1e-7 apart), never enough to flip a decision here.
    ours_eval, theirs_eval = series(ours, "eval_loss"), series(theirs, "eval_loss")
    assert [s for s, _ in ours_eval] == [s for s, _ in theirs_eval] == [2, 4, 6, 8]
    assert [v for _, v in ours_eval] == pytest.approx([v for _, v in theirs_eval], rel=1e-6)
    assert series(ours, "learning_rate") == series(theirs, "learning_rate")
    assert len({lr for _, lr in series(ours, "learning_rate")}) > 1  # the rate was reduced


OPTIMIZERS = [("adamw_torch", None), ("adamw_torch_fused", None), ("sgd", "momentum=0.9,dampening=0.1"),
              ("adagrad", "lr_decay=0.01,eps=1e-9"), ("rmsprop", "momentum=0.5,alpha=0.9,centered=true")]


@pytest.mark.parametrize("optim, optim_args", OPTIMIZERS)
def test_torch_optimizers_are_built_as_transformers_builds_them(optim, optim_args):
    options = dict(optim=optim, optim_args=optim_args, learning_rate=1e-3, adam_beta1=0.8)
    hf_cls, hf_kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(HF("out", **options))
    cls, kwargs = get_optimizer_cls_and_kwargs(TrainingArguments("out", **options))
    assert cls is hf_cls
    assert {k: v for k, v in kwargs.items()} == {k: v for k, v in hf_kwargs.items() if k != "params"}
    model = torch.nn.Linear(3, 1)
    cls([{"params": list(model.parameters())}], **kwargs).step()  # it builds and steps


PACKAGED = [("adamw_bnb_8bit", "bitsandbytes", "bitsandbytes"), ("paged_adamw_32bit", "bitsandbytes", "bitsandbytes"),
            ("lion_8bit", "bitsandbytes", "bitsandbytes"), ("rmsprop_bnb", "bitsandbytes", "bitsandbytes"),
            ("galore_adamw", "galore-torch", "galore_torch"), ("apollo_adamw", "apollo-torch", "apollo_torch"),
            ("lomo", "lomo-optim", "lomo_optim"), ("adalomo", "lomo-optim", "lomo_optim"),
            ("schedule_free_adamw", "schedulefree", "schedulefree"), ("adamw_torch_4bit", "torchao", "torchao"),
            ("adamw_torch_8bit", "torchao", "torchao"), ("grokadamw", "grokadamw", "grokadamw"),
            ("stable_adamw", "torch-optimi", "optimi"), ("adamw_torch_npu_fused", "torch-npu", "torch_npu"),
            ("adamw_torch_xla", "torch_xla", "torch_xla"), ("adamw_anyprecision", "torchdistx", "torchdistx")]


@pytest.mark.parametrize("optim, pip_name, module", PACKAGED)
def test_optimizers_of_absent_packages_fail_at_argument_time_naming_the_package(optim, pip_name, module):
    if importlib.util.find_spec(module) is not None:
        # Installed here: the name is not refused for a missing package (a device it needs may still be).
        try:
            TrainingArguments("out", optim=optim)
        except ArgumentError as error:
            assert f"pip install {pip_name}" not in str(error)
        return
    HF("out", optim=optim)  # transformers accepts the name until it builds the optimizer
    with pytest.raises(ArgumentError) as info:
        TrainingArguments("out", optim=optim)
    assert info.value.key == "optim" and f"(pip install {pip_name})" in str(info.value)
    assert "\n" not in str(info.value)


def test_every_transformers_optimizer_and_schedule_name_is_known():
    from workbench.core.args.enums import OptimizerNames, SchedulerType

    assert [o.value for o in OptimizerNames] == [o.value for o in transformers.training_args.OptimizerNames]
    assert [s.value for s in SchedulerType] == [s.value for s in transformers.SchedulerType]


def _trainer_with_schedule(tmp_path, max_steps=20, **options) -> Trainer:
    from workbench.data.builtin import load_builtin_data
    from workbench.models import MLPClassifier

    train, evals = load_builtin_data("random-classification", n_train=32)
    trainer = Trainer(MLPClassifier(), make_args(tmp_path, max_steps=max_steps, **options), train_dataset=train,
                      eval_dataset=evals)
    trainer.create_optimizer_and_scheduler(max_steps)
    return trainer


@pytest.mark.parametrize("name, kwargs", [
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}), ("warmup_stable_decay", {"num_decay_steps": 8}),
    ("inverse_sqrt", {}), ("cosine_warmup_with_min_lr", {"min_lr": 1e-5}), ("polynomial", {"power": 2.0}),
])
def test_a_live_learning_rate_edit_rescales_each_new_schedule(name, kwargs, tmp_path):
    trainer = _trainer_with_schedule(tmp_path, lr_scheduler_type=name, lr_scheduler_kwargs=kwargs, warmup_steps=3,
                                     learning_rate=1e-3)
    reference = get_scheduler(name, _sgd(1e-3), num_warmup_steps=3, num_training_steps=20,
                              scheduler_specific_kwargs=dict(kwargs))
    factors = [lr / 1e-3 for lr in _rates(reference, 20)]
    for _ in range(6):
        trainer.optimizer.step(), trainer.lr_scheduler.step()
    apply_edit(trainer, "learning_rate", 4e-3)
    for step in range(6, 20):
        assert math.isclose(trainer.lr_scheduler.get_last_lr()[0], 4e-3 * factors[step], rel_tol=1e-12)
        trainer.optimizer.step(), trainer.lr_scheduler.step()


def _rates(scheduler, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step(), scheduler.step()
    return out


def test_a_live_edit_rescales_a_plateau_schedule_and_survives_its_state_dict(tmp_path):
    trainer = _trainer_with_schedule(tmp_path, lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="steps",
                                     lr_scheduler_kwargs={"patience": 0, "factor": 0.5}, learning_rate=1e-2)
    scheduler = trainer.lr_scheduler
    scheduler.step(1.0), scheduler.step(2.0)  # one reduction: 5e-3
    assert trainer.get_learning_rates()[0] == pytest.approx(5e-3)
    apply_edit(trainer, "learning_rate", 4e-2)  # the base is 4e-2 now, the reduction kept
    assert trainer.get_learning_rates()[0] == pytest.approx(2e-2)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(2e-2)
    apply_edit(trainer, "lr_scale", 0.5)
    assert trainer.get_learning_rates()[0] == pytest.approx(1e-2)
    state = scheduler.state_dict()
    fresh = _trainer_with_schedule(tmp_path / "fresh", lr_scheduler_type="reduce_lr_on_plateau",
                                   eval_strategy="steps", lr_scheduler_kwargs={"patience": 0, "factor": 0.5})
    fresh.lr_scheduler.load_state_dict(state)
    assert fresh.lr_scheduler.base_lrs == scheduler.base_lrs and fresh.lr_scheduler.best == 1.0
    assert fresh.lr_scheduler.get_last_lr() == scheduler.get_last_lr()


def test_plateau_needs_evaluations_and_other_bad_schedules_are_one_line(tmp_path):
    with pytest.raises(ArgumentError) as info:
        TrainingArguments("out", lr_scheduler_type="reduce_lr_on_plateau")
    assert info.value.key == "lr_scheduler_type" and "eval_strategy" in str(info.value)
    with pytest.raises(ArgumentError, match="GreedyLR"):
        TrainingArguments("out", lr_scheduler_type="greedy", eval_strategy="steps")
    trainer = Trainer(torch.nn.Linear(2, 2), make_args(tmp_path, lr_scheduler_type="warmup_stable_decay"))
    trainer.create_optimizer()
    with pytest.raises(ValueError, match="^lr_scheduler_kwargs: warmup_stable_decay needs num_decay_steps"):
        trainer.create_scheduler(10)
