"""Bad input gets one clear line, in process: a trainer whose control port is taken says so before
writing, the endpoint check binds real sockets, load_split names a broken file's line, and
stale sockets go while live ones stay. test_clear_lines_e2e.py runs the same rules through the
``workbench`` command.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from support import listening_socket

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX mounts, signals and sockets")


def jsonl_rows(n: int) -> str:
    """``n`` JSON lines of a "text" column (small Python functions)."""
    return "".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(n))


def _broken_at_17() -> str:
    lines = jsonl_rows(30).splitlines(keepends=True)
    lines[16] = '{"text": "an unterminated string\n'  # line 17 of the file
    return "".join(lines)


DATA_CASES = {
    # name: (files to write, [data] table, the line's expected start)
    "empty jsonl": ({"train.jsonl": ""}, 'train = { path = "data/train.jsonl" }',
                    "data/train.jsonl: the file is empty (no rows)"),
    "malformed jsonl line": ({"train.jsonl": _broken_at_17()}, 'train = { path = "data/train.jsonl" }',
                             "data/train.jsonl:17: not valid JSON (Invalid control character at column 33)"),
    "ragged csv row": ({"train.csv": "text,label\na,1\nb,2\nc,3,4\nd,5\n"}, 'train = { path = "data/train.csv" }',
                       "data/train.csv:4: 3 fields where the header has 2 (a ragged row)"),
    "csv with only a header": ({"train.csv": "text,label\n"}, 'train = { path = "data/train.csv" }',
                               "data/train.csv: no rows; data.train needs at least one"),
    "missing file": ({}, 'train = { path = "data/nowhere.jsonl" }', "cfg.toml:5: data.train.path: file "
                                                                      "'data/nowhere.jsonl' does not exist"),
    "absent text column": ({"train.jsonl": jsonl_rows(30)}, 'train = { path = "data/train.jsonl" }\n'
                           'text_column = "body"', "cfg.toml: data.text_column (data.train): no column 'body' in "
                                                   "the data; columns: text"),
    "empty eval file": ({"train.jsonl": jsonl_rows(30), "eval.jsonl": "\n\n"},
                        'train = { path = "data/train.jsonl" }\neval = { path = "data/eval.jsonl" }',
                        "data/eval.jsonl: the file is empty (no rows)"),
    "empty eval slice": ({"train.jsonl": jsonl_rows(30)}, 'train = { path = "data/train.jsonl" }\n'
                         'eval = { path = "data/train.jsonl", split = "train[100%:]" }',
                         "data/train.jsonl: no rows in split 'train[100%:]'; data.eval needs at least one"),
    "malformed eval line": ({"train.jsonl": jsonl_rows(30), "eval.jsonl": _broken_at_17()},
                            'train = { path = "data/train.jsonl" }\neval = { path = "data/eval.jsonl" }',
                            "data/eval.jsonl:17: not valid JSON"),
}


def dead_pid() -> int:
    """The pid of a process that has exited (so no live run owns it)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_trainer_with_a_taken_control_port_says_so_before_writing(tmp_path):
    from workbench import Trainer, TrainingArguments
    from workbench.control.endpoint_check import EndpointError
    from workbench.data.builtin import load_builtin_data
    from workbench.models import MLPClassifier

    taken = listening_socket()
    port = taken.getsockname()[1]
    try:
        train, _ = load_builtin_data("random-classification", n_train=32, n_eval=8, in_features=8, num_classes=3)
        args = TrainingArguments(str(tmp_path / "lib-out"), control=True, control_port=port, max_steps=1,
                                 report_to="none", disable_tqdm=True)
        trainer = Trainer(model=MLPClassifier(in_features=8, hidden=8, num_classes=3), args=args,
                          train_dataset=train)
        with pytest.raises(EndpointError, match=f"^control_port: port {port} on 127.0.0.1 is already in use"):
            trainer.train()
    finally:
        taken.close()
    assert not (tmp_path / "lib-out").exists()


def test_the_endpoint_check_binds_real_sockets_and_warns_once_per_host():
    from workbench.control.endpoint_check import EndpointError, check_endpoint, public_warning

    check_endpoint(None)  # a Unix socket: nothing to check
    check_endpoint(0, "127.0.0.1")
    for port in (-1, 65536, True, "80"):
        with pytest.raises(EndpointError, match="expected a TCP port from 0 to 65535"):
            check_endpoint(port)
    taken = listening_socket()
    try:
        with pytest.raises(EndpointError, match=f"port {taken.getsockname()[1]} on 127.0.0.1 is already in use"):
            check_endpoint(taken.getsockname()[1], port_name="training.control_port")
    finally:
        taken.close()
    with pytest.raises(EndpointError, match="'192.0.2.1' is not an address of this machine"):
        check_endpoint(0, "192.0.2.1")
    with pytest.raises(EndpointError, match="set --control-port too"):
        check_endpoint(None, "127.0.0.1")
    assert public_warning("127.0.0.1") is None and public_warning("localhost") is None
    assert public_warning("::1") is None
    first = public_warning("0.0.0.0")
    assert first is not None and "reachable from the network" in first
    assert public_warning("0.0.0.0") is None  # said once per process


@pytest.mark.parametrize("case", ["empty jsonl", "malformed jsonl line", "ragged csv row", "csv with only a header",
                                  "empty eval slice"])
def test_load_split_names_the_file_and_line_in_process(tmp_path, monkeypatch, case):
    from workbench.data.datasets_io import load_split
    from workbench.data.file_errors import DataFileError

    files, table, expected = DATA_CASES[case]
    (tmp_path / "data").mkdir()
    for name, text in {**{"train.jsonl": jsonl_rows(30)}, **files}.items():
        (tmp_path / "data" / name).write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # names are shown relative to the working folder
    spec = table.splitlines()[-1].split("=", 1)[1].strip().strip("{} ")
    options = dict(part.strip().split(" = ") for part in spec.split(", "))
    options = {k: str(tmp_path / v.strip('"')) if k == "path" else v.strip('"') for k, v in options.items()}
    where = table.splitlines()[-1].split(" = ")[0]
    with pytest.raises(DataFileError) as caught:
        load_split(options, f"data.{where}")
    assert str(caught.value).startswith(expected), str(caught.value)
    assert len(str(caught.value).splitlines()) == 1


def test_stale_sockets_go_and_live_ones_stay(tmp_path):
    from workbench.control.discovery import remove_stale_sockets

    dead = dead_pid()
    stale = tmp_path / f"{dead}-1a2b3c4d.sock"
    made = []
    for path in (stale, tmp_path / f"{os.getpid()}-5e6f7a8b.sock"):
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        made.append(sock)
    answering = socket.socket(socket.AF_UNIX)
    answering.bind(str(tmp_path / f"{dead}-9c0d1e2f.sock"))
    answering.listen()
    made.append(answering)
    (tmp_path / f"{dead}-33333333.sock").write_text("not a socket")  # a user's file: left alone
    try:
        assert remove_stale_sockets(tmp_path) == [stale.name]
    finally:
        for sock in made:
            sock.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{os.getpid()}-5e6f7a8b.sock", f"{dead}-9c0d1e2f.sock", f"{dead}-33333333.sock"])
