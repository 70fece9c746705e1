"""The quickstart notebook in a real JupyterLab, in a real headless Chromium.

The test starts JupyterLab on 127.0.0.1 (its own port, token, settings and runtime
folders), opens a copy of sample_notebooks/01-quickstart.ipynb in Debian's Chromium driven
by Playwright (``executable_path``; no browser download), runs the cells up to the panel
with Shift+Enter as a user would, and checks in the page that the panel rendered (buttons,
charts with points) and that clicking Pause pauses the run (the kernel reports "paused"
and the step stops moving); then that the Schedule tab's Preview draws a planned rate and the
Fork tab forks two variants, with their table and curves (issue 28). A screenshot is saved under artifacts/ (ignored by git) and in
the test's tmp_path.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from support import REPO

CHROMIUM = Path(os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(os.environ.get("WORKBENCH_ARTIFACTS", REPO / "artifacts"))
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
CELLS_TO_PANEL = 4  # markdown, setup, markdown, "session.start(); panel"


def _requirements() -> str | None:
    if not CHROMIUM.is_file():
        return f"Chromium not found at {CHROMIUM} (apt-get install chromium; .ci/run installs it)"
    for module, extra in (("playwright", "playwright"), ("jupyterlab", "jupyterlab"), ("bqplot", "bqplot"),
                          ("ipykernel", "ipykernel")):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install -e '.[test]' installs {extra})"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab server on 127.0.0.1 serving a copy of the quickstart notebook; yields (url, token, log)."""
    reason = _requirements()
    if reason:
        pytest.skip(reason)
    root = tmp_path / "lab"
    (root / "sample_notebooks").mkdir(parents=True)
    # The notebook finds the repository by looking for examples/ above itself; a copy keeps
    # the repository's notebook free of outputs even if JupyterLab saves.
    (root / "examples").symlink_to(REPO / "examples")
    for name in ("01-quickstart", "05-steer-and-fork"):
        shutil.copy(REPO / "sample_notebooks" / f"{name}.ipynb", root / "sample_notebooks")
    config = tmp_path / "jupyter-config"
    (config / "labconfig").mkdir(parents=True)
    (config / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    # The notebook's "python3" kernel is this interpreter, found first through JUPYTER_PATH.
    from ipykernel.kernelspec import write_kernel_spec

    write_kernel_spec(tmp_path / "jupyter-data" / "kernels" / "python3")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, WORKBENCH_NOTEBOOK_RUNS=str(tmp_path / "runs"), JUPYTER_PATH=str(tmp_path / "jupyter-data"),
               WORKBENCH_NOTEBOOK_STEPS="5000",  # long enough to still be running when Pause is clicked
               JUPYTER_CONFIG_DIR=str(config), JUPYTER_RUNTIME_DIR=str(tmp_path / "jupyter-runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "lab-settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "lab-workspaces"),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={root}", "--LabApp.extension_manager=readonly",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")  # CI containers run as root
    log_path = tmp_path / "jupyterlab.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("JupyterLab did not start:\n" + log_path.read_text()[-4000:]) from None
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}", token, log_path
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # the server and the kernels it started
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(10)


CHART_POINTS_JS = """
() => [...document.querySelectorAll('.workbench-panel .bqplot.figure')].map(figure => ({
    title: (figure.querySelector('.mainheading') || {}).textContent || '',
    curves: [...figure.querySelectorAll('g.curve path.line')].map(p => (p.getAttribute('d') || '')
        .split(/[ML]/).filter(s => s.trim().length > 0 && s !== 'Z').length),
    dots: figure.querySelectorAll('path.dot').length,
}))
"""


def open_notebook(page, base: str, token: str, name: str, cells: int) -> list[str]:
    """Open sample_notebooks/``name`` in the page and wait until its first ``cells`` cells are on
    screen as the file has them and the kernel is idle; returns their types ("code"/"markdown").

    While a notebook loads, JupyterLab can show one empty code cell in its place; a test that
    picks "cell 0" then would press Shift+Enter on a cell that is about to be replaced. So the
    cells are compared with the file's, type by type, before anything is clicked.
    """
    notebook = json.loads((REPO / "sample_notebooks" / f"{name}.ipynb").read_text())
    types = [cell["cell_type"] for cell in notebook["cells"][:cells]]
    page.goto(f"{base}/lab/tree/sample_notebooks/{name}.ipynb?token={token}")
    page.wait_for_function(
        """(types) => {
            const cells = [...document.querySelectorAll('.jp-Notebook .jp-Cell')];
            return cells.length >= types.length && types.every((type, i) =>
                cells[i].classList.contains(type === 'code' ? 'jp-CodeCell' : 'jp-MarkdownCell'));
        }""", arg=types, timeout=90_000)
    # The kernel is started and idle once both the toolbar's indicator and the status bar say so.
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
    page.locator(".jp-StatusBar-Widget", has_text="Idle").first.wait_for(timeout=90_000)
    return types


def run_cell(page, index: int, is_code: bool, attempts: int = 3) -> None:
    """Select cell ``index`` and press Shift+Enter, as a user does; a code cell must start running.

    The cell is selected by clicking its prompt: a click on the bar left of it (the input
    collapser) would fold the input away and hide the prompt this function reads. Right after
    a notebook opens, JupyterLab can drop a run request that arrives while it is still
    connecting to the kernel; only then, with the prompt still "[ ]:" after 30 s, is the key
    pressed again, so a cell never runs twice (twice would start two runs in one kernel).
    """
    prompt = page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-InputArea-prompt").first
    for _ in range(attempts):
        prompt.click()
        page.keyboard.press("Escape")  # command mode: Shift+Enter runs the cell and selects the next
        page.keyboard.press("Shift+Enter")
        if not is_code:
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if re.search(r"\[(\*|\d+)\]", prompt.inner_text()):
                return
            time.sleep(0.2)
    raise AssertionError(f"cell {index} did not run after {attempts} Shift+Enter presses: its prompt reads "
                         f"{prompt.inner_text()!r}")


def assert_each_ran_once(page, types: list[str]) -> None:
    """The code cells' prompts read [1], [2], ... in order: each ran once, none twice."""
    prompts = page.locator(".jp-Notebook .jp-Cell")
    counts: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        counts = [prompts.nth(i).locator(".jp-InputArea-prompt").first.inner_text().strip()
                  for i, kind in enumerate(types) if kind == "code"]
        if "[*]:" not in counts:
            break
        time.sleep(0.5)
    assert counts == [f"[{n}]:" for n in range(1, len(counts) + 1)], counts


@pytest.mark.timeout(420)
def test_quickstart_panel_in_jupyterlab_and_chromium(jupyterlab, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    base, token, log_path = jupyterlab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "notebook-panel.png"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1500})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        try:
            types = open_notebook(page, base, token, "01-quickstart", CELLS_TO_PANEL)
            for index, kind in enumerate(types):
                run_cell(page, index, kind == "code")

            panel = page.locator(".workbench-panel")
            panel.wait_for(timeout=120_000)
            assert_each_ran_once(page, types)  # two runs in one kernel would share Accelerate's state
            for label in ("Pause", "Save", "Evaluate", "Stop", "Apply"):
                expect(panel.locator("button", has_text=label).first).to_be_visible()
            expect(panel.locator(".wb-status[data-status='running']")).to_be_visible(timeout=120_000)

            # Charts with points: the train loss line has several points, and the eval loss at
            # step 0 (eval_on_start) is drawn as a dot; the LR / grad norm chart has its lines too.
            def charts():
                return page.evaluate(CHART_POINTS_JS)
            deadline = time.monotonic() + 120
            while True:
                figures = charts()
                # (the Fork tab's chart comes after these two, empty until a fork)
                if len(figures) >= 2 and max(figures[0]["curves"], default=0) >= 3 and figures[0]["dots"] >= 1 \
                        and max(figures[1]["curves"], default=0) >= 3:
                    break
                assert time.monotonic() < deadline, f"charts never showed points: {figures}"
                time.sleep(0.5)
            assert figures[0]["title"] == "Loss"

            # Click Pause in the page: the kernel's Session pauses and the step stops moving.
            panel.locator("button", has_text="Pause").first.click()
            expect(panel.locator(".wb-status[data-status='paused']")).to_be_visible(timeout=60_000)
            expect(panel.locator("button", has_text="Resume").first).to_be_visible(timeout=10_000)
            progress = panel.locator(".wb-progress")
            step = progress.get_attribute("data-step")
            time.sleep(1.5)  # six refreshes of the observer
            assert progress.get_attribute("data-step") == step, "a paused run must not advance"
            assert int(step) > 0

            # The Schedule tab: Preview draws the cooldown's planned rate on the learning-rate
            # chart (one more curve with points), and nothing is applied.
            def drawn(figure: dict) -> int:
                return sum(1 for n in figure["curves"] if n >= 2)
            before = drawn(charts()[1])
            panel.locator(".lm-TabBar-tab", has_text="Schedule").first.click()
            panel.locator("input[placeholder^='steps=200']").fill("steps=100")
            panel.locator("button", has_text="Preview").first.click()
            expect(panel.get_by_text("preview of decay_now steps=100").first).to_be_visible(timeout=30_000)
            poll = time.monotonic() + 30
            while drawn(charts()[1]) <= before:
                assert time.monotonic() < poll, f"no preview curve on the rate chart: {charts()[1]}"
                time.sleep(0.3)

            # The Fork tab: two variants typed and forked from the pause; the table and the
            # variants' curves over the parent's loss appear, the run stays at its step.
            panel.locator(".lm-TabBar-tab", has_text="Fork").first.click()
            panel.locator("textarea").first.fill("a:\nb: learning_rate=1e-3")
            panel.locator(".widget-inline-hbox", has_text="steps").locator("input").first.fill("5")
            panel.locator("button", has_text="Fork").first.click()
            expect(panel.locator("table", has_text="same batches")).to_be_visible(timeout=120_000)
            poll = time.monotonic() + 30
            while True:
                fork = [f for f in charts() if f["title"].startswith("Fork")]
                if fork and drawn(fork[0]) >= 3:  # the parent and both variants
                    break
                assert time.monotonic() < poll, f"the fork's curves were not drawn: {fork}"
                time.sleep(0.3)
            assert progress.get_attribute("data-step") == step, "a fork puts the run back at the pause"
            panel.scroll_into_view_if_needed()
            panel.screenshot(path=str(shot))
            shutil.copy(shot, tmp_path / shot.name)
            page.screenshot(path=str(ARTIFACTS / "notebook-page.png"))
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "notebook-failure.png"))
            print(log_path.read_text()[-4000:])
            raise
        finally:
            browser.close()
    assert not [e for e in errors if "bqplot" in e or "widget" in e.lower()], errors
    assert shot.stat().st_size > 10_000


CELLS_TO_PROPOSAL = 6  # 05-steer-and-fork: markdown, setup, markdown, the run and its autopilot, markdown, the proposal


@pytest.mark.timeout(420)
def test_the_autopilots_proposal_in_jupyterlab_and_chromium(jupyterlab, tmp_path):
    """05-steer-and-fork up to its pause: the panel's Autopilot tab lists the dry-run proposal
    (its count in the tab title), and clicking Accept sends it (the decision reads applied)."""
    from playwright.sync_api import expect, sync_playwright

    base, token, log_path = jupyterlab
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1500})
        try:
            types = open_notebook(page, base, token, "05-steer-and-fork", CELLS_TO_PROPOSAL)
            for index, kind in enumerate(types):
                run_cell(page, index, kind == "code")
            panel = page.locator(".workbench-panel")
            panel.wait_for(timeout=120_000)
            expect(panel.locator(".wb-status[data-status='paused']")).to_be_visible(timeout=180_000)
            assert_each_ran_once(page, types)
            tab = panel.locator(".lm-TabBar-tab", has_text="Autopilot (1)").first
            expect(tab).to_be_visible(timeout=30_000)
            tab.click()
            table = panel.locator("table.workbench-autopilot")
            expect(table.locator("tr", has_text="lr_scale=0.5").filter(has_text="proposed")).to_be_visible()
            panel.locator("button", has_text="Accept").first.click()
            expect(table.locator("tr", has_text="lr_scale=0.5").filter(has_text="applied")).to_be_visible(
                timeout=60_000)
            panel.screenshot(path=str(tmp_path / "autopilot-tab.png"))
        except Exception:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "notebook-autopilot-failure.png"))
            print(log_path.read_text()[-4000:])
            raise
        finally:
            browser.close()
