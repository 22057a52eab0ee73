"""experiments/bench_host_sync.py: the control-flow costs gpu_check.sh measures for the model."""

import json

import pytest

from experiments import bench_host_sync as b
from kernels_pallas.perf_model import gpu


def test_loops_run_the_same_iterations():
    """The three loops compute the same thing (the cond's taken branch is the body's step), so
    the differences time only the control flow."""
    import jax.numpy as jnp
    import numpy as np

    x = jnp.ones((b.ROWS, b.WIDTH), jnp.float32)
    want = np.asarray(x)
    for _ in range(7):
        want = want * 0.5 + 1.0
    for name, fn in b.loops().items():
        np.testing.assert_allclose(np.asarray(fn(x, jnp.int32(7))), want, err_msg=name)


def test_quick_run_writes_json_and_table(tmp_path):
    out = tmp_path / "bench_host_sync.json"
    r = b.main(["--quick", "--iterations=20", f"--out={out}"])
    saved = json.loads(out.read_text())
    assert saved["iterations"] == 20 and set(saved["per_iteration_us"]) == {
        "fori", "while", "while+cond"
    }  # fmt: skip
    t = r["per_iteration_us"]
    assert r["loop_predicate_us"] == pytest.approx(t["while"] - t["fori"])
    assert r["branch_index_us"] == pytest.approx(t["while+cond"] - t["while"])
    assert r["model_host_sync_us"] == gpu.HOST_SYNC_S * 1e6 == pytest.approx(10.0)
    assert "model: gpu.HOST_SYNC_S (predicted)" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):
        b.main(["--iterations=0"])
