"""Multi-host plumbing: environment resolution and per-process rows, in one process.

The real 2-process run (``jax.distributed`` + gloo CPU collectives on loopback, 2 fake CPU
devices each, one 4-device mesh) is tests/test_trainer_sharded.py::test_two_processes_*: the
trainer's steps on both processes against one process, the rows each process fed, no compiles
once warm, and the checkpoint they wrote restored exactly in one process and onto one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.train import distributed as dist
from fp8rl_jax.train import sharding as sh


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
