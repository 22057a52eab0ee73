"""Executes experiments/notebooks/fp8_rollout_walkthrough.ipynb headless (nbclient)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "experiments" / "notebooks" / "fp8_rollout_walkthrough.ipynb"
GENERATOR = NOTEBOOK.with_name("make_fp8_rollout_walkthrough.py")


@pytest.fixture
def project_kernel(tmp_path, monkeypatch):
    """A `python3` kernel spec that runs this interpreter (the project venv).

    nbclient asks jupyter_client for the notebook's kernel name; jupyter_client takes the first
    `kernels/python3` on JUPYTER_PATH, then the user and system data dirs, and only falls back to
    ipykernel's built-in spec (sys.executable) when none exists. A system-wide python3 spec could
    point at another interpreter, so we put ours first.
    """
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (fp8rl_jax venv)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return "python3"


def test_notebook_is_generated_and_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(
        not c.get("outputs") and not c.get("execution_count")
        for c in nb.cells
        if c.cell_type == "code"
    )
    fresh = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import runpy; print(runpy.run_path({str(GENERATOR)!r})"
            "['build']().cells == __import__('nbformat').read("
            f"{str(NOTEBOOK)!r}, as_version=4).cells)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fresh.stdout.strip() == "True", "notebook differs from its generator; re-run it"


@pytest.mark.slow
def test_notebook_executes(project_kernel, tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=project_kernel,
        timeout=120,  # per cell
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 3  # (a) error histogram, (b) log-ratio histogram, (d) RL curves
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "blockwise 128x128" in text and "token_mult_prob_error" in text
    assert "TIS (C=2)" in text and "no correction" in text
