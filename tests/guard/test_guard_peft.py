"""The guard's rollback on a LoRA model: a rollback point holds the trainable (adapter) tensors
only, not the frozen base, and a rollback restores the adapter weights bitwise; a plain model's
point still holds its whole state dict."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from workbench import Guard, Trainer, TrainerCallback  # noqa: E402
from workbench.core.event_file import read_events  # noqa: E402
from workbench.core.trainer_utils import unwrap_model  # noqa: E402
from workbench.data.collators import DataCollatorForLanguageModeling  # noqa: E402
from workbench.guard.ring import RollbackPoint  # noqa: E402

from support.finetune import chat_lm_dataset, lora_model  # noqa: E402
from support.guarded import Poisoned, run  # noqa: E402
from support.runs import make_args  # noqa: E402

# A point every 2 steps, a read point every step: the NaN of step 5 rolls back to boundary 4.
ROLLBACK = Guard(nonfinite="rollback", snapshot_every=2, snapshots=1, window=4)
POISONED_BOUNDARY = 4


def _adapter(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class PoisonOnce(TrainerCallback):
    """Records the adapter at each step's start and, the first time the run is at
    ``POISONED_BOUNDARY``, writes a NaN into an adapter weight: the next step's loss is NaN,
    and only a rollback that restores the adapter gets the run finite again."""

    def __init__(self) -> None:
        self.model = None
        self.seen: list[tuple[int, dict[str, torch.Tensor]]] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.seen.append((state.global_step, _adapter(self.model)))
        if state.global_step == POISONED_BOUNDARY and sum(s == POISONED_BOUNDARY for s, _ in self.seen) == 1:
            with torch.no_grad():
                next(p for p in self.model.parameters() if p.requires_grad).view(-1)[0] = float("nan")


@pytest.fixture
def points(monkeypatch) -> list[RollbackPoint]:
    """Every rollback point the guard takes (RollbackPoint.take spied on)."""
    taken: list[RollbackPoint] = []
    take = RollbackPoint.take.__func__

    def spy(cls, run, detector):
        taken.append(take(cls, run, detector))
        return taken[-1]

    monkeypatch.setattr(RollbackPoint, "take", classmethod(spy))
    return taken


def test_a_rollback_on_a_lora_model_restores_the_adapter_bitwise_from_adapter_only_points(
        finetune_workspace, tmp_path, points):
    data, tokenizer = chat_lm_dataset(finetune_workspace.model)
    model = lora_model(finetune_workspace.model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    poison = PoisonOnce()
    poison.model = model
    trainer = Trainer(model=model, args=make_args(tmp_path, max_steps=8, per_device_train_batch_size=4,
                                                  learning_rate=1e-2, seed=0, use_cpu=True),
                      train_dataset=data, data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                      callbacks=[poison], guard=ROLLBACK)
    trainer.train()

    (event,) = [e for e in read_events(tmp_path) if e["event"] == "guard"]
    assert (event["step"], event["kind"], event["action"]) == (POISONED_BOUNDARY + 1, "nonfinite", "rollback")
    assert (event["restored_step"], event["source"]) == (POISONED_BOUNDARY, "memory")
    # The boundary's adapter as it was before the NaN, and as the rollback put it back: bitwise.
    before, after = [a for s, a in poison.seen if s == POISONED_BOUNDARY]
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert trainer.state.global_step == 8
    peft = unwrap_model(trainer.model)
    assert all(torch.isfinite(p).all() for p in peft.parameters())
    assert any(not torch.equal(before[n], p) for n, p in _adapter(peft).items())  # it trained on after
    assert all(torch.equal(base[n], p) for n, p in peft.named_parameters() if not p.requires_grad)

    # Each point holds the adapter's tensors and nothing of the frozen base: the tiny Llama's
    # only buffers (the rotary frequencies) are not persistent, so not in the state dict.
    trainable = _adapter(peft)
    assert len(points) >= 4
    for point in points:
        assert point.model.keys() == trainable.keys()
        assert _nbytes(point.model) == _nbytes(trainable) > 0
    full = sum(t.numel() * t.element_size() for t in peft.state_dict().values())
    assert full > 10 * _nbytes(trainable)


def test_a_lora_point_restores_the_adapter_and_leaves_the_base(finetune_workspace, tmp_path):
    """Taken and restored directly: the adapter comes back bitwise after steps that changed
    it; the frozen base, which the point does not hold, is left as it is."""
    data, tokenizer = chat_lm_dataset(finetune_workspace.model)
    trainer = Trainer(model=lora_model(finetune_workspace.model), args=make_args(
        tmp_path, max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, seed=0, use_cpu=True),
        train_dataset=data, data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()
    model = unwrap_model(trainer.model)
    point = RollbackPoint.take(trainer, {})
    saved, base = _adapter(model), {n: p for n, p in model.named_parameters() if not p.requires_grad}
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    point.restore(trainer)
    assert all(torch.equal(saved[n], p) for n, p in _adapter(model).items())
    # the very same frozen tensors, never copied out or in
    assert all(p is base[n] for n, p in model.named_parameters() if not p.requires_grad)
    # A fork's memory figure (checked against the limit before it starts) is what its
    # boundaries, rollback points, really hold: the adapter, not the base.
    from workbench.train.forking import Boundary, fork_memory

    assert fork_memory(trainer) == Boundary.take(trainer).nbytes < _nbytes(model.state_dict()) / 10


def test_a_plain_model_point_holds_its_whole_state_dict(tmp_path):
    trainer, _ = run(tmp_path / "run", Poisoned(), None, max_steps=2, logging_steps=2)
    point = RollbackPoint.take(trainer, {})
    state = unwrap_model(trainer.model).state_dict()
    assert point.model.keys() == state.keys()
    assert all(torch.equal(point.model[k], state[k]) for k in state)
    from workbench.train.forking import Boundary, fork_memory

    assert fork_memory(trainer) == Boundary.take(trainer).nbytes
