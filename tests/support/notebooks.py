"""Notebooks executed for real with nbclient, in a kernel that imports this checkout."""

from __future__ import annotations

import os
import sys
from pathlib import Path


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
    """Execute the notebook at ``path`` in a fresh kernel (its runs under ``runs``) and return it."""
    import nbclient
    import nbformat

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
    """Everything the notebook printed or displayed as text, in order."""
    out = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                out.append(output.get("text", ""))
            elif "data" in output and "text/plain" in output["data"]:
                out.append(output["data"]["text/plain"])
    return "".join(out)
