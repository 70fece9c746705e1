"""Every sample notebook runs top to bottom on a real IPython kernel (nbclient + ipykernel).

The notebooks assert what they demonstrate ("the run resumed from step 100", "best
checkpoint loaded"); an assertion that fails makes nbclient raise with the cell and its
traceback. Runs go to a temporary folder through WORKBENCH_NOTEBOOK_RUNS, and the
repository's copies must stay free of outputs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "sample_notebooks").glob("*.ipynb"))
EXPECTED = ["01-quickstart", "02-custom-loss-and-metrics", "03-checkpoints", "04-transformers-model"]


def test_the_sample_notebooks_are_there_and_have_no_outputs():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: outputs must be cleared"
        assert any("assert " in c.source for c in nb.cells if c.cell_type == "code"), f"{path.name} checks nothing"


def kernel_env(runs: Path) -> dict[str, str]:
    """The kernel is this interpreter: a "python3" kernelspec written for sys.executable, found
    first through JUPYTER_PATH, whatever other kernelspecs the machine has."""
    from ipykernel.kernelspec import write_kernel_spec

    write_kernel_spec(runs / "jupyter" / "kernels" / "python3")
    env = dict(os.environ)
    env["JUPYTER_PATH"] = os.pathsep.join([str(runs / "jupyter"), env.get("JUPYTER_PATH", "")]).rstrip(os.pathsep)
    env["WORKBENCH_NOTEBOOK_RUNS"] = str(runs)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def run_notebook(path: Path, runs: Path, timeout: int = 600):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    env = kernel_env(runs)
    old = dict(os.environ)
    os.environ.update(env)  # the kernel subprocess inherits this process's environment
    try:
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    return nb


def text_of(nb) -> str:
    out = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                out.append(output.get("text", ""))
            elif "data" in output and "text/plain" in output["data"]:
                out.append(output["data"]["text/plain"])
    return "".join(out)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs_top_to_bottom(name, tmp_path, capsys):
    nb = run_notebook(REPO / "sample_notebooks" / f"{name}.ipynb", tmp_path)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    text = text_of(nb)
    widgets = [o for c in nb.cells for o in c.get("outputs", [])
               if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    if name == "01-quickstart":
        assert "paused at step" in text and "eval loss" in text
        assert widgets, "the panel must be displayed as a widget"
        stats = text.split("panel refreshes: ", 1)[1].splitlines()[0]
        with capsys.disabled():
            print(f"\n01-quickstart panel refreshes in a real kernel: {stats}")
    elif name == "02-custom-loss-and-metrics":
        assert "best checkpoint loaded: checkpoint-" in text
    elif name == "03-checkpoints":
        assert "the run resumed from step 100" in text and "branch checkpoints:" in text
    elif name == "04-transformers-model":
        if importlib.util.find_spec("transformers") is None:
            assert "SKIPPED: transformers is not installed" in text and "pip install 'workbench[hf]'" in text
        else:
            assert "reloaded with from_pretrained" in text
    # the repository's copy is untouched (outputs stay out of version control)
    stored = json.loads((REPO / "sample_notebooks" / f"{name}.ipynb").read_text())
    assert all(not c.get("outputs") for c in stored["cells"] if c["cell_type"] == "code")
