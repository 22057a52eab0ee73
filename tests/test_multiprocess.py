"""Multi-host plumbing: environment resolution, per-process rows, and a real 2-process run.

The 2-process test starts two ``tests.multiprocess_worker`` processes on loopback
(``jax.distributed`` + gloo CPU collectives, 2 fake CPU devices each, one 4-device mesh), runs
RL steps, writes an orbax checkpoint from both processes, then a 1-process run recomputes the
steps on one device and restores that checkpoint. Tolerance as in test_sharding_mesh.py.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.train import distributed as dist
from fp8rl_jax.train import sharding as sh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 5e-5


def test_resolve_from_config_jax_env_and_slurm():
    assert dist.resolve(dist.DistributedConfig(), env={}) is None
    cfg = dist.DistributedConfig(coordinator_address="h:1", num_processes=4, process_id=3)
    assert dist.resolve(cfg, env={})["process_id"] == 3
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "1"}  # fmt: skip
    r = dist.resolve(dist.DistributedConfig(), env=env)
    assert (r["coordinator_address"], r["num_processes"], r["process_id"]) == (
        "10.0.0.1:1234", 2, 1
    )  # fmt: skip
    slurm = {"SLURM_NTASKS": "16", "SLURM_PROCID": "5",
             "SLURM_JOB_NODELIST": "h100-[007-008,010],login1"}  # fmt: skip
    r = dist.resolve(dist.DistributedConfig(), env=slurm)
    assert r["coordinator_address"] == f"h100-007:{dist.DEFAULT_PORT}"
    assert (r["num_processes"], r["process_id"]) == (16, 5)
    with pytest.raises(ValueError, match="no coordinator"):
        dist.resolve(dist.DistributedConfig(num_processes=2, process_id=0), env={})
    with pytest.raises(ValueError, match="outside 0..1"):
        dist.resolve(dist.DistributedConfig(coordinator_address="h:1", num_processes=2,
                                            process_id=2), env={})  # fmt: skip


def test_first_host_of_slurm_nodelists():
    assert dist._first_host("node1") == "node1"
    assert dist._first_host("gpu[03-05,07]") == "gpu03"
    assert dist._first_host("a[1,3],b2") == "a1"


def test_single_process_rows_and_global_batch_roundtrip():
    mesh = sh.make_mesh(sh.MeshConfig())
    s = sh.batch_shardings(jax.ShapeDtypeStruct((6, 3), jnp.int32), mesh)
    assert dist.process_rows(s, (6, 3)) == slice(0, 6)
    x = np.arange(18, dtype=np.int32).reshape(6, 3)
    g = dist.global_batch({"tokens_BT": x}, {"tokens_BT": s}, 6)["tokens_BT"]
    np.testing.assert_array_equal(dist.local_rows(g), x)
    np.testing.assert_array_equal(dist.gather_to_host(g), x)
    assert dist.is_main_process() and dist.main_process_only(lambda: 7)() == 7
    # One process configured explicitly (the environment may be a SLURM job): nothing to start.
    assert not dist.maybe_initialize_distributed(dist.DistributedConfig(num_processes=1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(k, None)
    return env


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_match_one_and_checkpoint_restores_in_one(tmp_path):
    port, ckpt = _free_port(), str(tmp_path / "ckpt")
    cmd = [sys.executable, "-m", "tests.multiprocess_worker", "--num-processes", "2",
           "--port", str(port), "--mesh", "fsdp=2,tensor=2", "--ckpt", ckpt]  # fmt: skip
    procs = [
        subprocess.Popen(
            [*cmd, "--process-id", str(i), "--out", str(tmp_path / f"p{i}.json")],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    ref = subprocess.run(
        [sys.executable, "-m", "tests.multiprocess_worker", "--num-processes", "1", "--devices",
         "1", "--restore", ckpt, "--out", str(tmp_path / "ref.json")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-4000:]
    p0, p1, r = (json.loads((tmp_path / f).read_text()) for f in ("p0.json", "p1.json", "ref.json"))

    assert (p0["process_count"], p0["devices"], p0["local_devices"]) == (2, 4, 2)
    assert (p0["rows"], p1["rows"]) == ([0, 8], [8, 16])  # each process fed its own rows
    assert p0["compiles_after_step0"] == p1["compiles_after_step0"] == 0
    assert p0["metrics"] == p1["metrics"]  # replicated metrics: identical on every process
    for got, want in zip(p0["metrics"], r["metrics"], strict=True):
        for k in want:
            assert abs(got[k] - want[k]) <= TOL * (1 + abs(want[k])), k
    assert r["restored_step"] == r["restored_state_step"] == 2
    assert r["restore_vs_written_max_diff"] == 0.0  # exact round trip 4 devices -> 1
    assert r["restore_vs_reference_max_diff"] < TOL
