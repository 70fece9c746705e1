"""The suite's fixtures and rules; shared helpers are in the ``support`` package.

Tests live in one folder per layer of ``workbench/`` (``tests/core`` ... ``tests/cli``, in the
order ``test_layers.py`` checks), each file under 600 lines. A file whose name ends in
``_e2e.py`` holds the slow end-to-end tests (real subprocesses, launchers, terminals, notebooks):
every test in it is marked ``slow`` here, and no other file has slow tests.
``pytest -m "not slow"`` is the development loop; CI runs everything.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workbench.guard import checks as guard_checks

from support import stop_all


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of a ``*_e2e.py`` file slow: the file's name says it, once."""
    for item in items:
        if Path(str(item.fspath)).stem.endswith("_e2e"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_run_left_training():
    """A test ends with no run training in this process: one left would refuse every later
    test's Trainer (one run a process, workbench/train/one_run.py), so it is stopped here and
    the test that left it fails, named."""
    yield
    from workbench.train.one_run import training_run

    from support.waiting import wait_until

    left = training_run()
    if left is None:
        return
    try:
        wait_until(lambda: training_run() is None, "the test's run to end", timeout=10)
    except AssertionError:
        owner = left.control_owner  # a Session (paused ones included) stops through its own door
        owner.stop(save=False) if owner is not None else left.stop_request.set("test teardown", save=False)
        wait_until(lambda: training_run() is None, "the left run to stop after a stop request", timeout=60)
        pytest.fail(f"the test left a run training ({left.args.output_dir}); stop it (the sessions fixture does)")


@pytest.fixture
def sessions():
    """Sessions a test made (append them): at the end each one still going, and each branch it
    handed over to, is stopped without saving, waited for and closed."""
    made: list = []
    yield made
    stop_all(made)


@pytest.fixture(params=["host", "device"])
def checks(request, monkeypatch) -> str:
    """Where the guard judges steps: on the host (what a CPU run does) or with device ops (what
    an accelerator run does; forced here on the CPU). A test taking it runs both ways."""
    monkeypatch.setattr(guard_checks, "HOST_DECIDES_ON_CPU", request.param == "host")
    return request.param


@pytest.fixture(scope="session")
def finetune_workspace(tmp_path_factory):
    """A local fine-tuning workspace (tiny Llama with a chat tokenizer, chat and
    prompt/completion jsonl; support/finetune.py), built once for the whole run."""
    pytest.importorskip("transformers")
    from support.finetune import build_workspace

    return build_workspace(tmp_path_factory.mktemp("finetune"))
