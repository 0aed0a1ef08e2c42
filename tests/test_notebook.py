"""notebooks/quickstart.ipynb, executed end to end on CPU in its small mode (what Colab
shows a newcomer first), and kept free of outputs in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_the_committed_notebook_has_no_outputs():
    """Outputs are made by running it, never committed (they would go stale)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(_code_cells(nb)) if c.outputs or c.execution_count is not None]
    assert not dirty, f"code cells {dirty} carry outputs: clear them before committing"


def test_the_readme_badge_and_the_install_cell_name_the_same_repository():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    source = "\n".join(c.source for c in nb.cells)
    repo = re.search(r'REPO_URL = "https://github.com/([\w.-]+/[\w.-]+)"', source).group(1)
    badge = f"https://colab.research.google.com/github/{repo}/blob/main/notebooks/quickstart.ipynb"
    assert badge in source
    readme = (ROOT / "README.md").read_text()
    assert badge in readme and "docs/tpu-vm.md" in readme


def test_the_notebook_runs_end_to_end_on_cpu(monkeypatch):
    """Every cell, in order, in a fresh kernel: a failing cell fails this test with that
    cell's traceback. Then what each part must have shown is there."""
    monkeypatch.setenv("JAXSERVE_NOTEBOOK_SMALL", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"a notebook cell failed:\n{e}")
    out = "\n".join(_text(c) for c in _code_cells(nb))
    assert "small mode: True" in out
    assert re.search(r"found in the prefix cache \(([1-9]\d*)% hit rate\)", out), "no prefix-cache hit"
    assert re.search(r"shared prefix found by the trace: [1-9]\d* tokens", out)
    assert "not chunked (1024 tokens a step): inter-token latency" in out
    assert re.search(r"gRPC: ['\"].+", out) and re.search(r"OpenAI API: ['\"].+", out), out
    assert "exit code: 0" in out
    # The chunked-prefill cell drew its plot.
    assert any("image/png" in o.get("data", {}) for c in _code_cells(nb) for o in c.outputs)
