"""The guard (issue #18): non-finite and spiking losses are skipped on the device, recorded
as ``guard`` events and in checkpoints, and a resumed run repeats them exactly.

The model is a linear regression whose loss is multiplied per sample by ``mult``: chosen
sample ids carry NaN (a non-finite loss) or a large factor (a spike), so which step goes
bad depends only on the (seeded) data order.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from conftest import StopAt, make_args
from workbench import Guard, Trainer, TrainerCallback
from workbench.config.loader import ConfigError, config_from_dict, load_config
from workbench.guard import checks as guard_checks
from workbench.core.args.training import ArgumentError
from workbench.core.event_file import read_events

N, DIM, BATCH = 64, 8, 4


class Poisoned(Dataset):
    """Regression rows with an id; rows in ``nan_ids`` give a NaN loss, rows in
    ``spike_ids`` a loss ``spike`` times larger."""

    def __init__(self, nan_ids=(), spike_ids=(), spike: float = 400.0) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, DIM, generator=gen)
        self.y = self.x @ torch.randn(DIM, 1, generator=gen)
        self.mult = torch.ones(N)
        self.mult[list(spike_ids)] = spike
        self.mult[list(nan_ids)] = float("nan")

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i], "mult": self.mult[i], "idx": i}


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(DIM, 1)

    def forward(self, x, labels=None, mult=None, idx=None):
        out = self.lin(x)
        per_sample = ((out - labels) ** 2).squeeze(-1) * mult
        return {"loss": per_sample.mean(), "logits": out}


class Order(TrainerCallback):
    """The sample ids of each step, in order (read from the batch the step trains on)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.steps: list[list[int]] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps.append(self.trainer.last_inputs["idx"].tolist())


def run(out, data: Poisoned, guard: Guard | None = None, callbacks=(), resume=None, **overrides):
    order = Order()
    options = dict(max_steps=N // BATCH, per_device_train_batch_size=BATCH, learning_rate=0.05,
                   lr_scheduler_type="linear", seed=3)
    options.update(overrides)
    trainer = Trainer(model=Regression(), args=make_args(out, **options), train_dataset=data,
                      callbacks=[order, *callbacks], guard=guard)
    for callback in (order, *callbacks):
        if hasattr(callback, "trainer"):
            callback.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer, order


@pytest.fixture(params=["host", "device"])
def checks(request, monkeypatch) -> str:
    """Where the steps are judged: on the host (what a CPU run does) or with device ops (what
    an accelerator run does; forced here on the CPU)."""
    monkeypatch.setattr(guard_checks, "HOST_DECIDES_ON_CPU", request.param == "host")
    return request.param


def weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def step_of(order: Order, sample: int) -> int:
    """The 1-based step that trained on ``sample``."""
    return next(i + 1 for i, ids in enumerate(order.steps) if sample in ids)


# ------------------------------------------------------------------------ configuration


def test_guard_defaults_off_and_validates_each_field():
    assert not Guard().active
    assert Guard(nonfinite="skip").active and Guard(spike="pause").active
    bad = [dict(nonfinite="drop"), dict(spike="stop"), dict(spike_factor=1.0), dict(spike_factor="3"),
           dict(window=0), dict(snapshots=0), dict(rollback_skip=-1), dict(lr_backoff=1.5),
           dict(max_interventions=0), dict(window=True)]
    for kwargs in bad:
        (key,) = kwargs
        with pytest.raises(ArgumentError) as info:
            Guard(**kwargs)
        assert info.value.key == key


def _config(tmp_path, guard_table: str):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nbuiltin = "mlp"\n[data]\nbuiltin = "random-classification"\n'
                    f"[training]\noutput_dir = \"out\"\n[guard]\n{guard_table}", encoding="utf-8")
    return path


def test_guard_table_in_config(tmp_path):
    run = load_config(_config(tmp_path, 'nonfinite = "skip"\nspike = "pause"\nspike_factor = 5.0\nwindow = 20\n'))
    assert run.guard == Guard(nonfinite="skip", spike="pause", spike_factor=5.0, window=20)
    assert run.raw["guard"]["window"] == 20  # recorded in output_dir/config.toml
    no_table = config_from_dict({"model": {"builtin": "mlp"}, "data": {"builtin": "random-classification"}}, base_dir=tmp_path)
    assert no_table.guard is None


@pytest.mark.timeout(120)  # the bug this guards against was a headless run that never ended
def test_init_starter_config_guards_a_diverging_headless_run(tmp_path, capsys):
    # `workbench init`'s config, shrunk to seconds and given a learning rate that overflows,
    # run as `workbench run --headless` does (with its control endpoint, so through a Session):
    # its [guard] (nonfinite = "skip", max_interventions = 5) skips the NaN steps, keeps the
    # weights finite and stops the run where the fifth is read, with a checkpoint. (It used to
    # pause there, as in a dashboard, and wait forever for a resume no one would send.)
    from safetensors.torch import load_file

    from workbench.cli import main

    config = tmp_path / "cfg.toml"
    assert main(["init", str(config)]) == 0
    tiny = {"training.max_steps": 12, "training.logging_steps": 2, "training.save_steps": 4,
            "training.eval_on_start": "false", "training.learning_rate": 1e30,
            "training.per_device_train_batch_size": 4, "model.options.n_embd": 32, "model.options.n_head": 2,
            "model.options.n_layer": 1, "model.options.block_size": 32, "data.options.block_size": 32,
            "data.options.max_chars": 20000}
    guard = load_config(config).guard
    assert (guard.nonfinite, guard.spike, guard.max_interventions) == ("skip", "rollback", 5)
    sets = [arg for key, value in tiny.items() for arg in ("--set", f"{key}={value}")]
    assert main(["run", str(config), "--headless", *sets]) == 0
    stderr = capsys.readouterr().err
    out = tmp_path / "runs" / "tiny-gpt"
    events = read_events(out)
    guard_records = [e for e in events if e["event"] == "guard"]
    assert len(guard_records) >= 5
    assert {(e["kind"], e["action"], e["value"]) for e in guard_records} == {("nonfinite", "skip", "nan")}
    step = guard_records[-1]["step"]  # stopped where the fifth was read
    assert step < 12 and events[-1]["event"] == "end" and events[-1]["status"] == "stopped", events[-1]
    assert events[-1]["step"] == step and not [e for e in events if e["event"] == "pause"]
    assert f"stopped by the guard at step {step} after {len(guard_records)} interventions" in stderr, stderr
    weights_file = out / f"checkpoint-{step}" / "model.safetensors"
    assert all(torch.isfinite(w).all() for w in load_file(str(weights_file)).values())


@pytest.mark.parametrize("table, line, message", [
    ('nonfinite = "skip"\nspike = "explode"\n', 9, "guard.spike: expected one of off, skip, rollback, pause"),
    ('window = 0\n', 8, "guard.window: expected an integer >= 1"),
    ('windw = 5\n', 8, "guard.windw: unknown key (did you mean window?)"),
    ('spike_factor = "3"\n', 8, "guard.spike_factor: expected"),
])
def test_bad_guard_values_are_one_located_line(tmp_path, table, line, message):
    path = _config(tmp_path, table)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert text.startswith(f"{path}:{line}: {message}"), text
    assert "\n" not in text


# ------------------------------------------------------------------------------- skip


NAN_SAMPLE = 37


def test_off_lets_nan_through_as_hf(tmp_path):
    trainer, order = run(tmp_path, Poisoned(nan_ids=[NAN_SAMPLE]))
    assert any(NAN_SAMPLE in ids for ids in order.steps)
    assert all(torch.isnan(w).all() for w in weights(trainer))


class MaskStep(TrainerCallback):
    """Masks one step's update by hand: parameters and optimizer state saved right before
    the optimizer step and put back right after it."""

    def __init__(self, step: int) -> None:
        self.step, self.trainer, self.saved = step, None, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            opt = self.trainer.optimizer
            self.saved = (weights(self.trainer), copy.deepcopy(opt.state_dict()))

    def on_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            params, opt_state = self.saved
            with torch.no_grad():
                for p, old in zip(self.trainer.model.parameters(), params):
                    p.copy_(old)
            self.trainer.optimizer.load_state_dict(opt_state)


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "sgd"])
def test_skip_equals_a_hand_masked_step(tmp_path, optim, checks):
    data = Poisoned(nan_ids=[NAN_SAMPLE])
    guarded, order = run(tmp_path / "g", data, Guard(nonfinite="skip"), optim=optim)
    bad_step = step_of(order, NAN_SAMPLE)
    assert all(torch.isfinite(w).all() for w in weights(guarded))
    assert guarded.state.global_step == N // BATCH  # the step counter still advanced

    # The same run without the guard, that step's update undone by hand, the NaN sample's
    # loss made finite first so only the masked step differs.
    mask = MaskStep(bad_step)
    clean = Poisoned(nan_ids=[NAN_SAMPLE])
    clean.mult[NAN_SAMPLE] = 1.0
    by_hand, hand_order = run(tmp_path / "h", clean, callbacks=[mask], optim=optim)
    assert hand_order.steps == order.steps
    for a, b in zip(weights(guarded), weights(by_hand)):
        assert torch.equal(a, b)


def clean_order(tmp_path) -> list[list[int]]:
    """The data order of these runs (it depends on the seed only, not on the model)."""
    return run(tmp_path / "order", Poisoned())[1].steps


def test_nonfinite_and_spike_are_skipped_and_recorded_as_events(tmp_path, checks):
    steps = clean_order(tmp_path)
    nan_sample, spike_sample = steps[2][0], steps[9][0]  # steps 3 and 10
    guard = Guard(nonfinite="skip", spike="skip", spike_factor=20.0, window=4)
    trainer, order = run(tmp_path / "run", Poisoned(nan_ids=[nan_sample], spike_ids=[spike_sample]), guard)
    assert order.steps == steps
    assert all(torch.isfinite(w).all() for w in weights(trainer))
    events = [e for e in read_events(tmp_path / "run") if e["event"] == "guard"]
    assert [(e["step"], e["kind"], e["action"], e["batches"], e["rank"]) for e in events] == [
        (3, "nonfinite", "skip", [2, 2], 0), (10, "spike", "skip", [9, 9], 0)]
    assert events[0]["value"] == "nan"
    # the dataset rows of each bad step, recomputed from the epoch's order
    assert events[0]["samples"] == steps[2] and nan_sample in events[0]["samples"]
    assert events[1]["samples"] == steps[9] and spike_sample in events[1]["samples"]
    assert "samples_by_rank" not in events[0]  # one process
    spike = events[1]
    assert spike["value"] > spike["threshold"] > 0
    assert len(trainer.workbench_state.guard["interventions"]) == 2


def test_without_the_guard_the_spike_is_trained_on(tmp_path):
    """The spike test above is not vacuous: unguarded, the spike step moves the weights far."""
    steps = clean_order(tmp_path)
    spike_sample = steps[9][0]
    guard = Guard(spike="skip", spike_factor=20.0, window=4)
    guarded, _ = run(tmp_path / "g", Poisoned(spike_ids=[spike_sample]), guard)
    plain, _ = run(tmp_path / "p", Poisoned(spike_ids=[spike_sample]))
    assert not all(torch.equal(a, b) for a, b in zip(weights(guarded), weights(plain)))


def test_resume_across_interventions_is_bitwise_equal(tmp_path, checks):
    steps = clean_order(tmp_path)
    # steps 3 and 10: after the resume at 7 only 3 steps are seen, so the spike is found
    # only with the running median the checkpoint carried
    data = Poisoned(nan_ids=[steps[2][0]], spike_ids=[steps[9][0]])
    guard = Guard(nonfinite="skip", spike="skip", spike_factor=20.0, window=4)
    whole, _ = run(tmp_path / "whole", data, guard, logging_steps=4)
    out = tmp_path / "parts"
    run(out, data, guard, callbacks=[StopAt(7)], logging_steps=4)
    resumed, _ = run(out, data, guard, resume=True, logging_steps=4)
    assert resumed.state.global_step == whole.state.global_step
    for a, b in zip(weights(whole), weights(resumed)):
        assert torch.equal(a, b)
    assert resumed.workbench_state.guard["interventions"] == whole.workbench_state.guard["interventions"]
    assert [i["step"] for i in whole.workbench_state.guard["interventions"]] == [3, 10]
    # the spike after the resume was found with the restored running median
    kinds = [(e["step"], e["kind"]) for e in read_events(out) if e["event"] == "guard"]
    assert kinds == [(3, "nonfinite"), (10, "spike")]


def test_cpu_runs_judge_steps_on_the_host_and_accelerators_on_the_device():
    from workbench.guard.monitor import GuardMonitor

    optimizer = torch.optim.AdamW([nn.Parameter(torch.ones(2))], fused=True)
    guard = Guard(nonfinite="skip", spike="skip")
    assert isinstance(GuardMonitor(guard, optimizer, torch.device("cpu")).checks, guard_checks.HostChecks)
    # a loss scaler or an engine must see every optimizer step: the device path masks instead
    assert isinstance(GuardMonitor(guard, optimizer, torch.device("cpu"), allow_found_inf=False).checks,
                      guard_checks.DeviceChecks)
    assert isinstance(GuardMonitor(guard, optimizer, torch.device("meta")).checks, guard_checks.DeviceChecks)


def _guarded_run(out, monkeypatch, on_host: bool, data: Poisoned, guard: Guard, **options):
    monkeypatch.setattr(guard_checks, "HOST_DECIDES_ON_CPU", on_host)
    return run(out, data, guard, **options)[0]


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "sgd"])
def test_host_and_device_checks_decide_alike_bit_for_bit(tmp_path, monkeypatch, optim):
    """The two paths flag the same steps with the same values and thresholds (float32 rule),
    train the same weights, and keep the same detector state; ties and NaNs included."""
    steps = clean_order(tmp_path)
    data = Poisoned(nan_ids=[steps[2][0]], spike_ids=[steps[9][0], steps[13][0]])
    guard = Guard(nonfinite="skip", spike="skip", spike_factor=20.0, window=4)
    runs = [_guarded_run(tmp_path / where, monkeypatch, where == "host", data, guard, optim=optim, logging_steps=5)
            for where in ("host", "device")]
    host, device = runs
    assert [i["step"] for i in host.workbench_state.guard["interventions"]] == [3, 10, 14]
    assert host.workbench_state.guard == device.workbench_state.guard  # interventions, ring, position: one format
    for a, b in zip(weights(host), weights(device)):
        assert torch.equal(a, b)


def test_a_checkpoint_saved_on_one_path_resumes_on_the_other(tmp_path, monkeypatch):
    """A GPU run's checkpoint resumed on a CPU (and back) decides as the uninterrupted run."""
    steps = clean_order(tmp_path)
    data = Poisoned(nan_ids=[steps[2][0]], spike_ids=[steps[9][0]])
    guard = Guard(nonfinite="skip", spike="skip", spike_factor=20.0, window=4)
    whole = _guarded_run(tmp_path / "whole", monkeypatch, True, data, guard, logging_steps=4)
    out = tmp_path / "parts"
    _guarded_run(out, monkeypatch, False, data, guard, callbacks=[StopAt(7)], logging_steps=4)
    resumed = _guarded_run(out, monkeypatch, True, data, guard, resume=True, logging_steps=4)
    assert resumed.workbench_state.guard == whole.workbench_state.guard
    for a, b in zip(weights(whole), weights(resumed)):
        assert torch.equal(a, b)


def test_max_interventions_stops_a_headless_run_with_a_checkpoint(tmp_path):
    steps = clean_order(tmp_path)
    data = Poisoned(nan_ids=[steps[4][0]])  # step 5
    trainer, order = run(tmp_path / "run", data, Guard(nonfinite="skip", max_interventions=1))
    assert trainer.state.global_step == 5 and len(order.steps) == 5
    checkpoint = tmp_path / "run" / "checkpoint-5"
    assert (checkpoint / "manifest.json").is_file()
    import json

    saved = json.loads((checkpoint / "workbench_state.json").read_text())
    assert [i["step"] for i in saved["guard"]["interventions"]] == [5]
    end = read_events(tmp_path / "run")[-1]  # who stopped it, for clients and schedulers
    assert (end["event"], end["status"], end["stop_reason"], end["exit_code"]) == ("end", "stopped", "guard", 0)
    assert "guard" not in json.loads((checkpoint / "trainer_state.json").read_text())  # HF-loadable
    assert all(torch.isfinite(w).all() for w in weights(trainer))


def test_stop_action_stops_with_a_checkpoint(tmp_path):
    steps = clean_order(tmp_path)
    trainer, _ = run(tmp_path / "run", Poisoned(nan_ids=[steps[5][0]]), Guard(nonfinite="stop"))
    assert trainer.state.global_step == 6
    assert (tmp_path / "run" / "checkpoint-6" / "manifest.json").is_file()
    assert all(torch.isfinite(w).all() for w in weights(trainer))


def test_session_pauses_on_the_guard_and_counts_interventions(tmp_path):
    import time

    from workbench import Session

    steps = clean_order(tmp_path)
    data = Poisoned(nan_ids=[steps[4][0]])  # step 5
    trainer = Trainer(model=Regression(), train_dataset=data,
                      args=make_args(tmp_path / "s", max_steps=N // BATCH, per_device_train_batch_size=BATCH,
                                     learning_rate=0.05, seed=3))
    session = Session(trainer, guard=Guard(nonfinite="pause"))
    session.start()
    try:
        deadline = time.monotonic() + 120
        while session.status != "paused":
            assert time.monotonic() < deadline and session.status not in ("finished", "failed"), session.status
            time.sleep(0.005)
        snap = session.snapshot()
        assert snap.step == 5 and snap.guard_interventions == 1
        (mark,) = snap.interventions
        assert (mark.step, mark.kind, mark.action, mark.value, mark.rank) == (5, "nonfinite", "pause", "nan", 0)
        assert mark.samples == tuple(steps[4])
        # a client attached over the control endpoint gets the same list
        from workbench.control.client import attach

        remote = attach(tmp_path / "s")
        try:
            assert remote.snapshot().interventions == snap.interventions
        finally:
            remote.close()
        session.resume()
        assert session.wait(120) == "finished"
    finally:
        if session.status not in ("finished", "failed", "stopped"):
            session.stop(save=False)
            session.resume()
    assert trainer.state.global_step == N // BATCH
    assert all(torch.isfinite(w).all() for w in weights(trainer))


def test_a_snapshot_lists_the_newest_interventions_and_counts_all(tmp_path):
    from workbench import Session
    from workbench.door.values import SNAPSHOT_INTERVENTIONS

    data = Poisoned(nan_ids=range(N))  # every step is non-finite: one intervention a step
    steps = SNAPSHOT_INTERVENTIONS + 14
    trainer = Trainer(model=Regression(), train_dataset=data,
                      args=make_args(tmp_path / "s", max_steps=steps, per_device_train_batch_size=BATCH,
                                     learning_rate=0.05, seed=3, logging_steps=50))
    session = Session(trainer, guard=Guard(nonfinite="skip", max_no_progress=None), control=False)
    assert session.start().wait(120) == "finished"
    snap = session.snapshot()
    assert snap.guard_interventions == steps
    assert [i.step for i in snap.interventions] == list(range(steps - SNAPSHOT_INTERVENTIONS + 1, steps + 1))
    assert all(torch.isfinite(w).all() for w in weights(trainer))


def _guarded_steps(guard: Guard, fused: bool, steps: list[tuple[float, float]], collect_at: set[int]):
    """Drive a GuardMonitor by hand with (loss, grad norm) pairs; returns (step, kind) of the
    interventions and the steps whose update left the weights unchanged."""
    from workbench.guard.monitor import GuardMonitor

    param = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param], lr=0.1, fused=fused)
    monitor = GuardMonitor(guard, optimizer, torch.device("cpu"))
    kinds, unchanged = [], []
    for step, (loss, norm) in enumerate(steps, start=1):
        before = param.detach().clone()
        param.grad = torch.full((3,), 0.5)
        monitor.add_loss(torch.tensor(loss))
        if not monitor.before_step(torch.tensor(norm)):
            optimizer.step()
        monitor.after_step()
        monitor.end_step(step, 0, step - 1, step - 1)
        if torch.equal(param, before):
            unchanged.append(step)
        if step in collect_at or step == len(steps):
            kinds += [(r["step"], r["kind"]) for r in monitor.collect()]
    return kinds, unchanged


@pytest.mark.parametrize("fused", [True, False])
def test_nonfinite_is_exactly_a_nan_or_inf_loss_or_grad_norm(fused, checks):
    """Not a finite pair whose sum overflows; a flagged step leaves the weights alone."""
    inf, nan = float("inf"), float("nan")
    steps = [(1.0, 1.0), (1.0, inf), (-inf, 1.0), (1e38, 3e38), (nan, 1.0), (1.0, nan), (1.0, 1.0)]
    kinds, unchanged = _guarded_steps(Guard(nonfinite="skip"), fused, steps, {3})
    assert kinds == [(2, "nonfinite"), (3, "nonfinite"), (5, "nonfinite"), (6, "nonfinite")]
    assert unchanged == [2, 3, 5, 6]


@pytest.mark.parametrize("fused", [True, False])
def test_spikes_against_the_running_median_and_rows_reused_after_a_collect(fused, checks):
    """window 2, factor 10: the median of the accepted losses sets the bar; bad steps stay out
    of it; the rows read at step 3 are reused by steps 4-6 without carrying a flag over."""
    steps = [(1.0, 1.0), (2.0, 1.0), (50.0, 1.0), (float("nan"), 1.0), (1.0, 1.0), (1.0, 1.0), (30.0, 1.0)]
    guard = Guard(nonfinite="skip", spike="skip", window=2, spike_factor=10.0)
    kinds, unchanged = _guarded_steps(guard, fused, steps, {3})
    assert kinds == [(3, "spike"), (4, "nonfinite"), (7, "spike")]
    assert unchanged == [3, 4, 7]


def test_no_host_syncs_on_non_logging_steps_with_the_guard_on(tmp_path, monkeypatch):
    from test_session import SyncCounter, _sync_trainer

    # The accelerator path (on the CPU the guard reads the loss on the host, where that is
    # no sync: test_cpu_runs_decide_on_the_host).
    monkeypatch.setattr(guard_checks, "HOST_DECIDES_ON_CPU", False)
    counter = SyncCounter(monkeypatch)
    trainer, end = _sync_trainer(tmp_path, counter)
    trainer.guard = Guard(nonfinite="skip", spike="skip", window=4)
    trainer.add_callback(end)
    trainer.train()
    assert trainer.loop is None and trainer.workbench_state.guard is not None  # the guard ran
    assert counter.windows == 18 and counter.total > 0
    assert counter.in_window == 0, counter.where


# --------------------------------------------------------------------------- rollback

# Snapshots at steps 0, 4, 8...; a log (a read point) every 4 steps; the spike at step 6 is
# read at step 8, so steps 5-8 are undone and the data resumes past batch 5 plus one more.
ROLLBACK = Guard(nonfinite="rollback", spike="rollback", spike_factor=20.0, window=4, snapshot_every=4,
                 snapshots=2, rollback_skip=1)


def guard_events(out) -> list[dict]:
    return [e for e in read_events(out) if e["event"] == "guard"]


def test_rollback_restores_a_snapshot_and_moves_past_the_bad_data(tmp_path, checks):
    steps = clean_order(tmp_path)
    nan_sample = steps[5][0]  # step 6 (micro-batch 5 of epoch 0)
    data = Poisoned(nan_ids=[nan_sample])
    trainer, order = run(tmp_path / "run", data, ROLLBACK, max_steps=12, logging_steps=4)
    assert trainer.state.global_step == 12
    assert all(torch.isfinite(w).all() for w in weights(trainer))
    (event,) = guard_events(tmp_path / "run")
    assert (event["step"], event["kind"], event["action"], event["batches"]) == (6, "nonfinite", "rollback", [5, 5])
    assert (event["restored_step"], event["source"]) == (4, "memory")
    # batches 4 (undone step 5), 5 (the bad one) and 6 (rollback_skip) are never trained again
    assert (event["skipped_from"], event["skipped_to"], event["skipped_batches"]) == ([0, 4], [0, 6], 3)
    assert event["samples"] == steps[5]
    skipped = [i for ids in steps[4:7] for i in ids]
    assert (event["skipped_samples"], event["skipped_sample_count"]) == (skipped, 12)
    after = [i for ids in order.steps[8:] for i in ids]
    assert not set(event["skipped_samples"]) & set(after)  # named rows never come back
    # a run's recording (`workbench watch`) lists it as the live snapshot would
    from workbench.control.watch import open_watch

    (mark,) = open_watch(tmp_path / "run").snapshot().interventions
    assert (mark.step, mark.action, mark.restored_step, mark.skipped_samples, mark.samples) == \
        (6, "rollback", 4, 12, tuple(steps[5]))
    # 8 steps ran before the rollback was read, then steps 5-12 on batches 7-14
    assert order.steps[:8] == steps[:8]
    assert order.steps[8:] == steps[7:15]
    seen = [i for ids in order.steps for i in ids]
    assert seen.count(nan_sample) == 1  # the bad sample is never replayed
    for ids in steps[4:7]:  # trained once before the rollback, never after it
        assert all(seen.count(i) == 1 for i in ids)
    position = trainer.position  # the data offset is the loop's position (core/run.py)
    assert (position.skipped, position.epoch, position.batch) == (3, 0, 15)


def test_a_long_rollback_keeps_the_count_not_the_list(tmp_path, monkeypatch):
    import workbench.guard.rollback as rollback

    steps = clean_order(tmp_path)
    monkeypatch.setattr(rollback, "MAX_LISTED_SAMPLES", 11)  # this rollback skips 12 rows
    run(tmp_path / "run", Poisoned(nan_ids=[steps[5][0]]), ROLLBACK, max_steps=12, logging_steps=4)
    (event,) = guard_events(tmp_path / "run")
    assert (event["skipped_samples"], event["skipped_sample_count"]) == (None, 12)
    assert (event["skipped_from"], event["skipped_to"]) == ([0, 4], [0, 6])  # the range stands for them
    assert event["samples"] == steps[5]  # the bad step's own rows are always named


def test_rollback_lr_backoff_is_a_recorded_live_edit(tmp_path):
    steps = clean_order(tmp_path)
    guard = dataclasses.replace(ROLLBACK, lr_backoff=0.5)
    trainer, _ = run(tmp_path / "run", Poisoned(nan_ids=[steps[5][0]]), guard, max_steps=12, logging_steps=4,
                     lr_scheduler_type="constant")
    assert trainer.lr_scheduler.base_lrs == [0.025] and trainer.get_learning_rates()[0] == 0.025
    assert [(e["step"], e["lr_scale"]) for e in trainer.workbench_state.live_edits] == [(4, 0.5)]
    assert guard_events(tmp_path / "run")[0]["lr_scale"] == 0.5


def test_resume_after_a_rollback_is_bitwise_equal(tmp_path):
    steps = clean_order(tmp_path)
    data = Poisoned(nan_ids=[steps[5][0]])
    whole, whole_order = run(tmp_path / "whole", data, ROLLBACK, max_steps=12, logging_steps=4)
    out = tmp_path / "parts"
    # stopped at step 10 after the rollback (8 steps, back to 4, then 5-10): checkpoint-10
    first, _ = run(out, data, ROLLBACK, callbacks=[StopAt(10)], max_steps=12, logging_steps=4)
    assert [e["action"] for e in guard_events(out)] == ["rollback"]
    resumed, resumed_order = run(out, data, ROLLBACK, resume=True, max_steps=12, logging_steps=4)
    assert resumed_order.steps == whole_order.steps[-2:]  # the data order carries on past the skip
    assert resumed.state.global_step == whole.state.global_step == 12
    for a, b in zip(weights(whole), weights(resumed)):
        assert torch.equal(a, b)
    assert resumed.workbench_state.guard["interventions"] == whole.workbench_state.guard["interventions"]
    assert resumed.position == whole.position  # the data offset: the loop's position


def test_resume_from_a_save_between_a_snapshot_and_the_bad_step_is_bitwise_equal(tmp_path):
    # save_steps 5 and snapshot_every 4 do not line up. A run resumed from checkpoint-5 has
    # an empty ring, so the bad step 6 (read at 8) rolls it back to checkpoint-5; the
    # uninterrupted run must go back to step 5 as well (its save there is a snapshot point),
    # not to its periodic snapshot at 4. (Found by a SIGKILL on the CLI: tests/test_guard_kill.py.)
    steps = clean_order(tmp_path)
    data = Poisoned(nan_ids=[steps[5][0]])
    options = dict(max_steps=12, logging_steps=4, save_strategy="steps", save_steps=5)
    whole, whole_order = run(tmp_path / "whole", data, ROLLBACK, **options)
    out = tmp_path / "parts"
    run(out, data, ROLLBACK, callbacks=[StopAt(5)], **options)
    assert guard_events(out) == []
    resumed, resumed_order = run(out, data, ROLLBACK, resume=True, **options)
    (memory,), (disk,) = guard_events(tmp_path / "whole"), guard_events(out)
    assert (memory["restored_step"], memory["source"]) == (5, "memory")
    assert (disk["restored_step"], disk["source"]) == (5, "checkpoint")
    same = ("step", "kind", "action", "batches", "samples", "skipped_from", "skipped_to", "skipped_samples")
    assert {k: memory[k] for k in same} == {k: disk[k] for k in same}
    assert resumed_order.steps == whole_order.steps[5:]
    assert resumed.state.global_step == whole.state.global_step == 12
    for a, b in zip(weights(whole), weights(resumed)):
        assert torch.equal(a, b)
    assert resumed.position == whole.position  # the data offset: the loop's position


def test_an_epoch_end_save_reads_the_guard_first(tmp_path):
    # save_strategy "epoch" asks for the save after the last step's own read point. The bad
    # last step of epoch 0 used to be found by the save itself, which cannot roll back: the
    # checkpoint held a rollback never carried out, and a resume from it never did it either.
    import shutil

    steps = clean_order(tmp_path)
    data = Poisoned(nan_ids=[steps[15][0]])  # step 16, the last of epoch 0 (and again each epoch)
    guard = dataclasses.replace(ROLLBACK, snapshot_every=5, rollback_skip=0)
    options = dict(max_steps=40, logging_steps=100, save_strategy="epoch")
    whole, _ = run(tmp_path / "whole", data, guard, **options)
    first = guard_events(tmp_path / "whole")[0]
    assert (first["step"], first["action"], first["restored_step"]) == (16, "rollback", 15)
    checkpoints = sorted((tmp_path / "whole").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert [p.name for p in checkpoints] == ["checkpoint-27", "checkpoint-40"]  # step 16's save was undone too
    import json

    for path in checkpoints:
        records = json.loads((path / "workbench_state.json").read_text())["guard"]["interventions"]
        assert all(r.get("restored_step") is not None for r in records if r["action"] == "rollback"), path.name
    shutil.copytree(checkpoints[0], tmp_path / "parts" / checkpoints[0].name)
    resumed, _ = run(tmp_path / "parts", data, guard, resume=True, **options)
    assert resumed.state.global_step == whole.state.global_step == 40
    for a, b in zip(weights(whole), weights(resumed)):
        assert torch.equal(a, b)


def test_empty_ring_rolls_back_from_the_newest_checkpoint(tmp_path):
    steps = clean_order(tmp_path)
    data = Poisoned(nan_ids=[steps[5][0]])
    # In memory: snapshots at 0, 3, 6; the bad step 6 is read at 6 and rolls back to 3.
    memory_guard = dataclasses.replace(ROLLBACK, snapshot_every=3)
    memory, memory_order = run(tmp_path / "memory", data, memory_guard, max_steps=12, logging_steps=4)
    assert [(e["restored_step"], e["source"]) for e in guard_events(tmp_path / "memory")] == [(3, "memory")]
    # From disk: a run resumed at checkpoint-3 holds no snapshot (the next is at 100), so the
    # bad step (read at 8) rolls back to checkpoint-3, the same state as the snapshot.
    disk_guard = dataclasses.replace(ROLLBACK, snapshot_every=100)
    out = tmp_path / "disk"
    run(out, data, disk_guard, callbacks=[StopAt(3)], max_steps=12, logging_steps=4)
    disk, disk_order = run(out, data, disk_guard, resume=True, max_steps=12, logging_steps=4)
    (event,) = guard_events(out)
    assert (event["restored_step"], event["source"], event["skipped_from"], event["skipped_to"]) == \
        (3, "checkpoint", [0, 3], [0, 6])
    assert disk_order.steps[5:] == memory_order.steps[-9:] == steps[7:16]
    assert disk.state.global_step == 12
    for a, b in zip(weights(memory), weights(disk)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------ several ranks

# Both scripts: a linear model whose loss is multiplied by ``factor`` while ``poison`` is set,
# and data rows that carry their sample id.
_RANK_PRELUDE = '''
import json, sys
import torch
from torch import nn
from workbench import Guard, Trainer, TrainerCallback, TrainingArguments
from workbench.guard import checks as guard_checks

guard_checks.HOST_DECIDES_ON_CPU = sys.argv[-1] == "host"  # else the accelerator path, forced

class Model(nn.Module):
    def __init__(self, factor="nan"):
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(4, 1)
        self.poison, self.factor = False, float(factor)
    def forward(self, x, labels=None, idx=None):
        loss = ((self.lin(x) - labels) ** 2).mean()
        return {"loss": loss * self.factor if self.poison else loss}

class Data(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(4, generator=g), "labels": torch.randn(1, generator=g), "idx": i}
'''

_RANK_SCRIPT = _RANK_PRELUDE + '''
class PoisonRank1(TrainerCallback):
    """Only rank 1's loss of step 3 is NaN."""
    def __init__(self, model):
        self.model = model
    def on_step_begin(self, args, state, control, **kwargs):
        self.model.poison = state.global_step + 1 == 3 and torch.distributed.get_rank() == 1

model = Model()
args = TrainingArguments(sys.argv[1], max_steps=6, per_device_train_batch_size=4, learning_rate=0.05,
                         logging_steps=2, save_strategy="no", report_to="none", disable_tqdm=True,
                         optim=sys.argv[2])
trainer = Trainer(model=model, args=args, train_dataset=Data(64), callbacks=[PoisonRank1(model)],
                  guard=Guard(nonfinite="skip"))
trainer.train()
rank = torch.distributed.get_rank()
out = {"interventions": trainer.workbench_state.guard["interventions"],
       "weights": [p.detach().tolist() for p in model.parameters()]}
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(out, f)
# Leave together, as workbench run's ranks do: a rank tearing gloo down while the other still
# talks to it can abort at interpreter exit ("terminate called without an active exception").
trainer.accelerator.wait_for_everyone()
torch.distributed.destroy_process_group()
'''


def _launch_ranks(tmp_path, script: str, *argv: str) -> list[dict]:
    """Run ``script`` on 2 CPU ranks through the real launcher; each rank's JSON result."""
    import json
    import subprocess

    from workbench.distributed.launch import launcher_command

    path = tmp_path / "ranks.py"
    path.write_text(script)
    out = tmp_path / "out"
    command, env = launcher_command(2, [str(path), str(out), *argv])
    repo = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    env = {**env, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("optim,where", [("adamw_torch_fused", "device"), ("sgd", "device"),
                                         ("adamw_torch_fused", "host")])
def test_nan_on_one_rank_is_skipped_by_both_at_the_same_step(tmp_path, optim, where):
    import math

    ranks = _launch_ranks(tmp_path, _RANK_SCRIPT, optim, where)
    # rank 0's own loss was finite, yet it skipped the same step (the flags were reduced)
    assert [(i["step"], i["rank"]) for i in ranks[0]["interventions"]] == [(3, 0)]
    assert [(i["step"], i["rank"]) for i in ranks[1]["interventions"]] == [(3, 1)]
    assert ranks[0]["interventions"][0]["value"] != "nan" and ranks[1]["interventions"][0]["value"] == "nan"
    # every rank names the step's rows of both ranks (4 each, disjoint), the same on each
    by_rank = ranks[0]["interventions"][0]["samples_by_rank"]
    assert by_rank == ranks[1]["interventions"][0]["samples_by_rank"]
    assert [len(ids) for ids in by_rank] == [4, 4] and not set(by_rank[0]) & set(by_rank[1])
    assert ranks[0]["interventions"][0]["samples"] == by_rank[0] + by_rank[1]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the replicas stayed equal
    assert all(math.isfinite(v) for w in ranks[0]["weights"] for row in (w if isinstance(w[0], list) else [w])
               for v in row)


_ROLLBACK_RANK_SCRIPT = _RANK_PRELUDE + '''
class PoisonRank1Once(TrainerCallback):
    """Rank 1's loss of the first step 6 is bad (NaN or 1000x); every step's sample ids are kept."""
    def __init__(self, model):
        self.model, self.trainer, self.order, self.bad = model, None, [], None
    def on_step_begin(self, args, state, control, **kwargs):
        ids = self.trainer.last_inputs["idx"].tolist()
        self.order.append([state.global_step + 1, ids])
        self.model.poison = self.bad is None and state.global_step + 1 == 6
        if self.model.poison:
            self.bad = ids  # this rank's samples of the bad step (rank 0's were fine)
        self.model.poison = self.model.poison and torch.distributed.get_rank() == 1

model = Model(sys.argv[2])
args = TrainingArguments(sys.argv[1], max_steps=12, per_device_train_batch_size=4, learning_rate=0.05,
                         logging_steps=4, save_strategy="no", report_to="none", disable_tqdm=True,
                         seed=3, optim="adamw_torch_fused")
poison = PoisonRank1Once(model)
guard = Guard(nonfinite="rollback", spike="rollback", spike_factor=20.0, window=4, snapshot_every=4,
              snapshots=2, rollback_skip=1)
# 128 rows: 16 steps an epoch, so no sample comes twice in the run
trainer = Trainer(model=model, args=args, train_dataset=Data(128), callbacks=[poison], guard=guard)
poison.trainer = trainer
trainer.train()
rank = torch.distributed.get_rank()
out = {"interventions": trainer.workbench_state.guard["interventions"], "order": poison.order, "bad": poison.bad,
       "step": trainer.state.global_step, "weights": [p.detach().tolist() for p in model.parameters()]}
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(out, f)
# Leave together, as workbench run's ranks do: a rank tearing gloo down while the other still
# talks to it can abort at interpreter exit ("terminate called without an active exception").
trainer.accelerator.wait_for_everyone()
torch.distributed.destroy_process_group()
'''


@pytest.mark.slow
@pytest.mark.parametrize("factor,kind,where", [("nan", "nonfinite", "host"), ("1000", "spike", "host"),
                                                ("1000", "spike", "device")])
def test_bad_step_on_one_rank_rolls_back_both_at_the_same_step(tmp_path, factor, kind, where):
    import math

    ranks = _launch_ranks(tmp_path, _ROLLBACK_RANK_SCRIPT, factor, where)
    out = tmp_path / "out"
    for rank, data in enumerate(ranks):
        # Both ranks found the bad step 6 (rank 0 through the reduced flags) at the log point of
        # step 8, and both went back to the snapshot of step 4.
        (record,) = data["interventions"]
        assert (record["step"], record["rank"], record["kind"], record["action"]) == (6, rank, kind, "rollback")
        assert (record["restored_step"], record["source"], record["skipped_batches"]) == (4, "memory", 3)
        assert data["step"] == 12
        steps = [step for step, _ in data["order"]]
        assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 5, 6, 7, 8, 9, 10, 11, 12]
        # This rank's samples of the bad step are never trained again after the rollback.
        after = [i for _, ids in data["order"][8:] for i in ids]
        assert data["bad"] and not set(data["bad"]) & set(after)
    assert ranks[0]["bad"] != ranks[1]["bad"]  # each rank had its own shard of the bad step
    assert ranks[0]["interventions"][0]["value"] != ranks[1]["interventions"][0]["value"]  # only rank 1's was bad
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the replicas stayed equal
    assert all(math.isfinite(v) for w in ranks[0]["weights"] for row in (w if isinstance(w[0], list) else [w])
               for v in row)
    events = [e for e in read_events(out) if e["event"] == "guard"]
    assert [(e["step"], e["action"], e["restored_step"]) for e in events] == [(6, "rollback", 4)]
