"""Every sample notebook runs top to bottom on a real IPython kernel (nbclient + ipykernel), end
to end. The notebooks assert what they demonstrate ("the run resumed from step 100", "best
checkpoint loaded"); an assertion that fails makes nbclient raise with the cell and its
traceback. Runs go to a temporary folder through WORKBENCH_NOTEBOOK_RUNS, and the
repository's copies must stay free of outputs.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from support import REPO
from support.notebooks import run_notebook, text_of
from test_sample_notebooks import EXPECTED

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


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
    elif name == "05-steer-and-fork":
        assert "the autopilot proposes lr_scale=0.5" in text and "the cooldown would end at step" in text
        assert "kept " in text and "finished at step 400" in text
        assert "-fork1-" in text and "saved " in text  # the other variant, as a checkpoint of its own
        assert widgets, "the panel must be displayed as a widget"
    # the repository's copy is untouched (outputs stay out of version control)
    stored = json.loads((REPO / "sample_notebooks" / f"{name}.ipynb").read_text())
    assert all(not c.get("outputs") for c in stored["cells"] if c["cell_type"] == "code")
