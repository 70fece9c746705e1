"""Every sample notebook runs top to bottom on a real IPython kernel (nbclient + ipykernel).

The notebooks assert what they demonstrate ("the run resumed from step 100", "best
checkpoint loaded"); an assertion that fails makes nbclient raise with the cell and its
traceback. Runs go to a temporary folder through WORKBENCH_NOTEBOOK_RUNS, and the
repository's copies must stay free of outputs.
"""

from __future__ import annotations

import pytest

from support import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((REPO / "sample_notebooks").glob("*.ipynb"))
EXPECTED = ["01-quickstart", "02-custom-loss-and-metrics", "03-checkpoints", "04-transformers-model",
            "05-steer-and-fork"]


def test_the_sample_notebooks_are_there_and_have_no_outputs():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: outputs must be cleared"
        assert any("assert " in c.source for c in nb.cells if c.cell_type == "code"), f"{path.name} checks nothing"
