"""The guard (issue #18): non-finite and spiking losses are skipped on the device, recorded
as ``guard`` events and in checkpoints, and a resumed run repeats them exactly.

The model is a linear regression whose loss is multiplied per sample by ``mult``: chosen
sample ids carry NaN (a non-finite loss) or a large factor (a spike), so which step goes
bad depends only on the (seeded) data order.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from workbench import Guard, Trainer, TrainerCallback
from workbench.config.loader import ConfigError, config_from_dict, load_config
from workbench.core.args.training import ArgumentError
from workbench.core.event_file import read_events
from workbench.guard import checks as guard_checks

from support import StopAt, make_args, wait_until
from support.guarded import BATCH, N, Poisoned, Regression, clean_order, run, step_of, weights
from support.syncs import SyncCounter, sync_trainer

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
    out = tmp_path / "runs" / "cfg"  # the starter's output_dir follows the config's name
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

    from workbench import Session

    steps = clean_order(tmp_path)
    data = Poisoned(nan_ids=[steps[4][0]])  # step 5
    trainer = Trainer(model=Regression(), train_dataset=data,
                      args=make_args(tmp_path / "s", max_steps=N // BATCH, per_device_train_batch_size=BATCH,
                                     learning_rate=0.05, seed=3))
    session = Session(trainer, guard=Guard(nonfinite="pause"))
    session.start()
    try:
        wait_until(lambda: session.status in ("paused", "finished", "failed"), "the guard's pause")
        assert session.status == "paused", session.status
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

    # The accelerator path (on the CPU the guard reads the loss on the host, where that is
    # no sync: test_cpu_runs_decide_on_the_host).
    monkeypatch.setattr(guard_checks, "HOST_DECIDES_ON_CPU", False)
    counter = SyncCounter(monkeypatch)
    trainer, end = sync_trainer(tmp_path, counter)
    trainer.guard = Guard(nonfinite="skip", spike="skip", window=4)
    trainer.add_callback(end)
    trainer.train()
    assert trainer.loop is None and trainer.workbench_state.guard is not None  # the guard ran
    assert counter.windows == 18 and counter.total > 0
    assert counter.in_window == 0, counter.where
