"""One clear line instead of a traceback: the user's mistakes and the machine's failures.

Every test here runs ``workbench`` as a real subprocess and checks what the user sees: the
exit code, exactly one line on stderr (never a traceback), and what is on disk afterwards:
nothing where nothing should be written, and the checkpoints saved before a failure still
verify. Nothing is mocked:

* a bad or taken control port, a host this machine does not have (12);
* broken data files: empty, a malformed JSON line, a ragged csv row, a missing file or
  column, an empty eval set (13);
* a full disk during a save, as a real 4 MiB tmpfs filled by the run's own callback (where
  this process may mount one), and a real file-size limit (``RLIMIT_FSIZE``, which gives
  EFBIG instead of ENOSPC, and works anywhere); a read-only output_dir at start and during a
  save (a read-only bind mount; without root: mode 0555) (14);
* ``workbench checkpoints`` on a damaged checkpoint, and the sockets of killed runs (15).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from workbench.checkpoint.store import CheckpointStore
from workbench.core.event_file import read_events

from support import REPO, listening_socket, poll_until
from test_clear_lines import DATA_CASES, dead_pid  # the data cases and helpers, in process

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX mounts, signals and sockets")
# Each `workbench` subprocess pays torch's import (about 5 s of CPU): the CLI tests are marked
# slow; the in-process tests of the same checks run in the development loop.

TINY = """\
[model]
builtin = "tiny-gpt"
options = {{ n_layer = 1, n_head = 2, n_embd = 32, block_size = 32 }}
[data]
{data}
[training]
output_dir = "{output_dir}"
max_steps = {max_steps}
per_device_train_batch_size = 4
learning_rate = 3e-3
logging_steps = {logging_steps}
save_steps = 2
report_to = "none"
seed = 3
{training}
{hooks}
"""
BUILTIN_DATA = 'builtin = "python-source"\noptions = { block_size = 32, max_chars = 20000 }'

# The run's own callback breaks the storage at the end of step 3, so the save of step 4 is
# the first to meet it (step 2's checkpoint was written before).
HOOKS = '''\
import os
import subprocess
import time

from workbench import TrainerCallback

AT = 3


class BreakStorage(TrainerCallback):
    """At the end of step AT, as BREAK_MODE says: fill the output_dir's tmpfs but for 64 KiB
    (tmpfs), cap file sizes at 64 KiB (rlimit), mount the output_dir read-only over itself
    (mount, as root) or make it mode 0555 (chmod)."""

    def on_step_end(self, args, state, control, **kwargs):
        mode = os.environ.get("BREAK_MODE")
        if state.global_step != AT:
            return
        if mode == "tmpfs":
            # With save_async, step 2's checkpoint may still be being written: let it land first.
            for _ in range(600):
                if os.path.isdir(os.path.join(args.output_dir, "checkpoint-2")):
                    break
                time.sleep(0.05)
            info = os.statvfs(args.output_dir)
            with open(os.path.join(os.path.dirname(args.output_dir), "filler"), "wb") as f:
                f.write(bytes(info.f_bavail * info.f_frsize - 65536))
        elif mode == "rlimit":
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
        elif mode == "mount":
            subprocess.run(["mount", "--bind", args.output_dir, args.output_dir], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", args.output_dir], check=True)
        elif mode == "chmod":
            os.chmod(args.output_dir, 0o555)
'''


def write_config(folder: Path, output_dir: str = "out", *, data: str = BUILTIN_DATA, max_steps: int = 6,
                 logging_steps: int = 2, training: str = "", hooks: str = "", name: str = "cfg.toml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    hook_table = f'[hooks]\ncallbacks = ["clear_hooks:{hooks}"]' if hooks else ""
    if hooks:
        (folder / "clear_hooks.py").write_text(HOOKS, encoding="utf-8")
    path = folder / name
    path.write_text(TINY.format(data=data, output_dir=output_dir, max_steps=max_steps, logging_steps=logging_steps,
                                training=training, hooks=hook_table), encoding="utf-8")
    return path


def workbench(*args: object, cwd: Path, env: dict[str, str] | None = None,
              timeout: float = 240) -> subprocess.CompletedProcess:
    """``workbench ARGS`` in a subprocess, as a user types it."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "workbench.cli", *map(str, args)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def one_line(result: subprocess.CompletedProcess, code: int) -> str:
    """The single stderr line of a run that exited with ``code``."""
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def can_mount(folder: Path) -> bool:
    """Whether this process may mount here (root, and a kernel and container that allow it)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    probe = folder / ".mount-probe"
    probe.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                        capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", str(probe)], check=True)
    probe.rmdir()
    return ok


def unmount_all(folder: Path) -> None:
    subprocess.run(["umount", "-R", "-l", str(folder)], capture_output=True)


# -- 12. the control endpoint, checked before anything is written ---------------------------------


@pytest.mark.parametrize("options, expected", [
    (["--control-port", "99999"], "--control-port: expected a TCP port from 0 to 65535 (0: any free port), got 99999"),
    (["--control-port", "0", "--control-host", "192.0.2.1"], "--control-host: '192.0.2.1' is not an address of "
                                                              "this machine"),
    (["--control-host", "127.0.0.1"], "--control-host names the address of a TCP endpoint; set --control-port too"),
])
def test_a_bad_control_endpoint_is_one_line_before_anything_is_written(tmp_path, options, expected):
    config = write_config(tmp_path)
    line = one_line(workbench("run", config, "--headless", *options, cwd=tmp_path), 2)
    assert line.startswith(f"workbench: {expected}"), line
    assert not (tmp_path / "out").exists()  # no config.toml, no events.jsonl, no folder


def test_a_taken_control_port_is_one_line_on_the_command_line_and_in_the_config(tmp_path):
    taken = listening_socket()
    port = taken.getsockname()[1]
    try:
        config = write_config(tmp_path)
        line = one_line(workbench("run", config, "--headless", "--control-port", port, cwd=tmp_path), 2)
        assert f"--control-port: port {port} on 127.0.0.1 is already in use" in line, line
        config = write_config(tmp_path, training=f"control_port = {port}", name="in-config.toml")
        line = one_line(workbench("run", config, "--headless", cwd=tmp_path), 2)
        assert f"training.control_port: port {port} on 127.0.0.1 is already in use" in line, line
    finally:
        taken.close()
    assert not (tmp_path / "out").exists()


def test_a_public_control_host_is_said_once_and_the_run_goes_on(tmp_path):
    config = write_config(tmp_path, max_steps=2)
    result = workbench("run", config, "--headless", "--control-port", "0", "--control-host", "0.0.0.0", cwd=tmp_path)
    line = one_line(result, 0)
    assert "warning: the control endpoint listens on every interface" in line
    assert "reachable from the network" in line and "token" in line
    assert (tmp_path / "out" / "checkpoint-2").is_dir()


# -- 13. broken data files ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_a_broken_data_file_is_one_line_naming_the_file_and_line(tmp_path, case):
    files, table, expected = DATA_CASES[case]
    (tmp_path / "data").mkdir()
    for name, text in files.items():
        (tmp_path / "data" / name).write_text(text, encoding="utf-8")
    if "text_column" not in table:
        table += '\ntext_column = "text"'
    table += '\ntokenizer = "char"\nmax_length = 32'
    config = write_config(tmp_path, data=table, max_steps=2, training='eval_strategy = "steps"\neval_steps = 2'
                          if "eval =" in table else "")
    line = one_line(workbench("run", config.name, "--headless", cwd=tmp_path), 2)
    assert line.startswith(f"workbench: {expected}"), line
    # Every split is read and checked before anything is written: not even the tokenized
    # train set's cache (output_dir/data_cache) is left behind by a broken eval file.
    assert not (tmp_path / "out").exists()


# -- 14. a full disk, a read-only folder --------------------------------------------------------------


@pytest.fixture
def read_only_mode(tmp_path) -> str:
    """How this process can make a folder read-only: a read-only bind mount (root, where
    mounts are allowed: EROFS) or mode 0555 (not root: EACCES)."""
    if can_mount(tmp_path):
        return "mount"
    if os.geteuid() == 0:
        pytest.skip("root ignores mode 0555 and may not mount here")
    return "chmod"


def make_read_only(folder: Path, mode: str) -> None:
    if mode == "mount":
        subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
    else:
        os.chmod(folder, 0o555)


def make_writable(folder: Path, mode: str) -> None:
    if mode == "mount":
        unmount_all(folder)
    else:
        os.chmod(folder, 0o755)


def _final_weights(output_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(output_dir / f"checkpoint-{step}" / "model.safetensors")


@pytest.fixture
def small_disk(tmp_path, request):
    """A 4 MiB tmpfs to fill ("tmpfs": skipped where this process may not mount), or a plain
    folder and a file-size limit ("rlimit", which works anywhere); yields (folder, mode)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if request.param == "rlimit":
        yield folder, "rlimit"
        return
    if not can_mount(tmp_path):
        pytest.skip("cannot mount a tmpfs here (not root, or not allowed); the rlimit case runs instead")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], check=True)
    yield folder, "tmpfs"
    unmount_all(folder)


@pytest.mark.parametrize("small_disk, save_async", [("tmpfs", False), ("tmpfs", True), ("rlimit", False)],
                         ids=["tmpfs-sync", "tmpfs-save_async", "file_size_limit-sync"], indirect=["small_disk"])
def test_a_full_disk_during_a_save_is_one_line_and_loses_nothing(tmp_path, small_disk, save_async):
    disk, mode = small_disk
    out = disk / "out"
    config = write_config(tmp_path, str(out), max_steps=8, hooks="BreakStorage",
                          training=f"save_async = {str(save_async).lower()}")
    line = one_line(workbench("run", config, "--headless", cwd=tmp_path, env={"BREAK_MODE": mode}), 1)
    assert line.startswith(f"workbench: training failed: saving checkpoint-4 into {out} failed: "), line
    if mode == "tmpfs":
        assert "no space left on device (the checkpoint needs about " in line and " free there)" in line, line
    else:
        assert "file too large" in line and "ulimit -f: 64.0 KB" in line, line
    assert "enforce fail" not in line and "inline_container" not in line
    assert "no partial .tmp-checkpoint-4 is left, checkpoint-2 intact" in line, line
    assert not list(out.glob(".tmp-*")) and not (out / "checkpoint-4").exists()
    store = CheckpointStore(out)
    assert store.verify(out / "checkpoint-2") == (True, None)
    last = read_events(out)[-1]
    assert last["event"] == "error" and last["exit_code"] == 1 and "checkpoint-4" in last["error"]
    assert line.endswith(f"; details in {out / 'events.jsonl'}")

    # Once there is room again, --resume continues from checkpoint-2 and ends where a run
    # that never met a full disk ends, bit for bit.
    (disk / "filler").unlink(missing_ok=True)
    resumed = workbench("run", config, "--headless", "--resume", cwd=tmp_path, env={"BREAK_MODE": "off"})
    assert resumed.returncode == 0, resumed.stderr
    assert [e["step"] for e in read_events(out) if e["event"] == "start"][-1] == 2
    reference = write_config(tmp_path / "ref", str(tmp_path / "ref" / "out"), max_steps=8,
                             training=f"save_async = {str(save_async).lower()}")
    assert workbench("run", reference, "--headless", cwd=tmp_path / "ref").returncode == 0
    for name, value in _final_weights(tmp_path / "ref" / "out", 8).items():
        assert torch.equal(value, _final_weights(out, 8)[name]), name


def test_an_output_dir_turned_read_only_during_a_save_says_so_unmasked(tmp_path, read_only_mode):
    mode = read_only_mode
    out = tmp_path / "out"
    # logging every 5 steps: the save of step 4 is the first write after step 3
    config = write_config(tmp_path, str(out), max_steps=8, logging_steps=5, hooks="BreakStorage")
    try:
        line = one_line(workbench("run", config, "--headless", cwd=tmp_path, env={"BREAK_MODE": mode}), 1)
    finally:
        make_writable(out, mode)
    assert line.startswith(f"workbench: training failed: saving checkpoint-4 into {out} failed: the folder is "), line
    assert ("read-only (read-only file system)" if mode == "mount" else "not writable (permission denied)") in line
    assert "checkpoint-2 intact" in line and "make the folder writable" in line
    # The run's clean-up (.lock, control.json) fails too on a read-only folder, and stays quiet:
    # the line above is the original error, nothing masks it.
    assert ".lock" not in line and "control.json" not in line
    assert CheckpointStore(out).verify(out / "checkpoint-2") == (True, None)
    assert not list(out.glob(".tmp-*")) and not (out / "checkpoint-4").exists()


def test_a_read_only_output_dir_at_start_is_one_line_and_nothing_is_created(tmp_path, read_only_mode):
    mode = read_only_mode
    folder = tmp_path / "ro"
    config = write_config(tmp_path, str(folder / "out"), max_steps=2)
    assert workbench("run", config, "--headless", cwd=tmp_path).returncode == 0
    if mode == "chmod":
        os.chmod(folder / "out", 0o555)
    make_read_only(folder, mode)
    try:
        line = one_line(workbench("run", config, "--headless", "--resume", cwd=tmp_path), 2)
        assert line.startswith(f"workbench: training.output_dir: cannot write to {folder / 'out'} ("), line
        fresh = write_config(tmp_path, str(folder / "new"), max_steps=2, name="fresh.toml")
        line = one_line(workbench("run", fresh, "--headless", cwd=tmp_path), 2)
        assert line.startswith(f"workbench: training.output_dir: cannot create {folder / 'new'} in {folder} ("), line
        assert not (folder / "new").exists()
    finally:
        make_writable(folder, mode)
        make_writable(folder / "out", mode)
    assert CheckpointStore(folder / "out").verify(folder / "out" / "checkpoint-2") == (True, None)


# -- 15. the checkpoints command verifies; stale sockets go -------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("listed")
    config = write_config(folder, max_steps=4)
    result = workbench("run", config, "--headless", cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder / "out"


def test_checkpoints_verifies_hashes_and_never_calls_a_damaged_one_complete(tmp_path, finished_run):
    out = tmp_path / "out"
    shutil.copytree(finished_run, out)
    weights = out / "checkpoint-2" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8] ^= 0xFF  # same size: only a hash can tell
    weights.write_bytes(bytes(data))

    table = workbench("checkpoints", out, cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:3]}
    assert "DAMAGED" in rows["checkpoint-2"].split() and "verified" in rows["checkpoint-4"].split()
    assert "complete" not in table.stdout
    assert ("checkpoint-2: model.safetensors does not match its sha256 (changed after the checkpoint was sealed?)"
            in table.stdout)

    quick = workbench("checkpoints", out, "--quick", cwd=tmp_path)
    assert quick.returncode == 0 and quick.stdout.count("sizes ok (hashes not checked)") == 2, quick.stdout

    listed = json.loads(workbench("checkpoints", out, "--json", cwd=tmp_path).stdout)
    assert [(r["name"], r["state"], r["complete"], r["verified"], r["hashes_checked"]) for r in listed] == [
        ("checkpoint-2", "DAMAGED", False, False, True), ("checkpoint-4", "verified", True, True, True)]
    assert "model.safetensors" in listed[0]["problem"]
    listed = json.loads(workbench("checkpoints", out, "--json", "--quick", cwd=tmp_path).stdout)
    assert [(r["state"], r["hashes_checked"]) for r in listed] == [("sizes ok (hashes not checked)", False)] * 2


def test_the_next_run_removes_the_sockets_of_killed_runs_and_only_those(tmp_path):
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    sockets = runtime / "workbench"
    killed = write_config(tmp_path / "a", max_steps=100000)
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "run", str(killed), "--headless"],
                            cwd=killed.parent, env={**os.environ, "PYTHONPATH": str(REPO), **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    control = killed.parent / "out" / "control.json"
    assert poll_until(control.exists, 120, every=0.2), "the run never served its endpoint"
    left = Path(json.loads(control.read_text())["socket"])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert left.exists()  # a SIGKILL leaves the socket behind

    # Not to be touched: a socket named after a live process (this one), and one whose pid
    # is gone but where something still answers (a run in another pid namespace).
    live = sockets / f"{os.getpid()}-0a0b0c0d.sock"
    quiet = socket.socket(socket.AF_UNIX)
    quiet.bind(str(live))
    answering = sockets / f"{dead_pid()}-0e0f0a0b.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(answering))
    listener.listen()
    try:
        fresh = write_config(tmp_path / "b", max_steps=2)
        assert workbench("run", fresh, "--headless", cwd=fresh.parent, env=env).returncode == 0
        assert not left.exists()
        assert live.exists() and answering.exists()
        assert sorted(p.name for p in sockets.iterdir()) == sorted([live.name, answering.name])  # its own went too
    finally:
        quiet.close()
        listener.close()
