"""Mosaic GPU interpret mode on few CPU cores: ``backend.prepare_gpu_interpret`` keeps XLA:CPU
from running the emulated threads' barrier callbacks on its intra-op pool, where they starved
the pool and hung (test_cluster_k's 3-chunk f32 case, on every run pinned to one core)."""

import logging
import os
import subprocess
import sys

import pytest

from kernels_pallas import backend

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAG = backend.GPU_INTERPRET_XLA_FLAG

# One CTA cluster of 3 K chunks x 2 warpgroups: 6 emulated threads meeting at cluster barriers.
_CLUSTER = """
import jax.numpy as jnp
from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.fp8_matmul.mgpu_config import MgpuConfig
from kernels_pallas.fp8_matmul.test_cluster_k import _operands
xq, wq = _operands(16, 384, 256, seed=9)
cfg = MgpuConfig(32, 64, 2, swap_ab=True, split_k=3, cluster_k=True)
y = mgpu.fp8_matmul_mgpu(xq, wq, out_dtype=jnp.float32, interpret=True, config=cfg)
print("done", y.shape)
"""


def test_cluster_kernel_interpreted_on_one_core_finishes():
    """The case that hung, in a process pinned to one CPU with the flag the test run carries
    (conftest.py): it finishes (~10 s; a hang runs into the 240-s limit)."""
    assert FLAG in os.environ["XLA_FLAGS"]
    cpu = min(os.sched_getaffinity(0))
    pin = f"import os; os.sched_setaffinity(0, {{{cpu}}})\n"
    proc = subprocess.run([sys.executable, "-c", pin + _CLUSTER], cwd=REPO, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done (16, 256)" in proc.stdout


@pytest.fixture
def fresh(monkeypatch):
    """No XLA_FLAGS and no backend yet (as in a script before its first computation)."""
    from jax._src import xla_bridge

    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    started = [False]
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: started[0])
    return started


def test_prepare_adds_the_flag_before_the_backend_starts(fresh):
    assert backend.prepare_gpu_interpret()
    assert os.environ["XLA_FLAGS"] == f"--xla_backend_optimization_level=0 {FLAG}"
    assert backend.prepare_gpu_interpret()  # idempotent
    assert os.environ["XLA_FLAGS"].count(FLAG.split("=")[0]) == 1


def test_prepare_keeps_the_users_setting(fresh, monkeypatch):
    mine = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    monkeypatch.setenv("XLA_FLAGS", mine)
    assert backend.prepare_gpu_interpret()
    assert os.environ["XLA_FLAGS"] == mine


def test_prepare_after_the_backend_started_warns_and_changes_nothing(fresh, caplog):
    fresh[0] = True
    with caplog.at_level(logging.WARNING, logger="kernels_pallas.backend"):
        assert not backend.prepare_gpu_interpret()
    assert os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=0"
    assert FLAG in caplog.text and "may hang" in caplog.text
