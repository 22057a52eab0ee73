"""Expert-parallel MoE (``models/moe_parallel.py``) on 8 fake devices vs one device.

The worker (``tests/moe_parallel_worker.py``, a subprocess: the fake device count is fixed when
jax is imported) runs one MoE layer on mesh data=2, expert=4 (E = 8: two experts per shard, 24
tokens: 3 per device) and on one device: F32 training weights forward and gradients (w.r.t.
every expert weight, the router and the input), FP8 rollout weights forward (the grouped FP8
GEMM's XLA path), and a forward of 6 tokens (split over data only: the psum variant).
Everything is f32 apart from the FP8 operands, so the results differ only by
summation order (a token's k expert rows are summed per shard, then across shards): we allow
1e-5 relative to the largest value (observed: ~5e-7).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, "-m", "tests.moe_parallel_worker", "--mesh", "data=2,expert=4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout[out.stdout.index("{") :])


@pytest.mark.slow
def test_expert_parallel_forward_and_grads_match_single_device(report):
    r = report
    assert r["max_y_diff"] <= TOL * (1 + r["y_scale"])
    assert r["max_grad_diff"] <= TOL * (1 + r["g_scale"])
    assert r["max_fp8_y_diff"] <= TOL * (1 + r["fp8_y_scale"])
    assert r["max_y_diff_unsplit"] <= TOL * (1 + r["y_scale"])  # tokens not split over expert
    assert "expert" in r["out_sharding"]  # tokens come back split as they went in


@pytest.mark.slow
def test_dispatch_in_token_chunks_matches_single_device(report):
    """TOKEN_CHUNK = 4: each shard's 12 gathered tokens dispatched in 3 chunks (a loop in the
    program), forward and gradients still equal to one device's."""
    r = report
    assert r["chunked_loops"] >= 1
    assert r["max_y_diff_chunked"] <= TOL * (1 + r["y_scale"])
    assert r["max_grad_diff_chunked"] <= TOL * (1 + r["g_scale"])
    assert r["max_fp8_y_diff_chunked"] <= TOL * (1 + r["fp8_y_scale"])


@pytest.mark.parametrize(
    "n, chunk, chunks",
    [
        (12, 4, 3),
        (12, 5, 3),
        (16384, 16384, 1),
        (655360, 16384, 40),
        (655360, 4096, 160),
        (7, 2, 7),
    ],
)
def test_num_token_chunks_is_the_fewest_equal_chunks(n, chunk, chunks):
    from fp8rl_jax.models.moe_parallel import num_token_chunks

    assert num_token_chunks(n, chunk) == chunks
    assert n % chunks == 0 and n // chunks <= chunk


@pytest.mark.slow
def test_each_shard_runs_only_its_experts(report):
    r = report
    local = r["num_experts"] // r["expert_shards"]
    # the FP8 expert stacks of the per-device program: E/n experts (gate/up [2, 128, 64] and
    # down [2, 64, 128]), and no collective moves a weight: tokens go out (all-gather; XLA:CPU
    # widens FP8 to f16 on the wire) and the outputs come back (reduce-scatter), nothing else.
    assert r["ep_f8_params"] == [f"f8e4m3fn[{local},128,64]", f"f8e4m3fn[{local},64,128]"]
    assert set(r["ep_collectives"]) == {"all-gather", "reduce-scatter"}
    assert r["ep_collectives"]["reduce-scatter"] == ["f32[3,128]"]  # [N/devices, D]
    # Without shard_map, GSPMD replicates the grouped GEMM: all 48 rows on every device and
    # the experts' weights all-reduced per row tile (the problem moe_parallel solves).
    assert any(s.startswith("(f16[13,64,128]") for s in r["gspmd_collectives"]["all-reduce"])


@pytest.mark.slow
def test_bf16_kernel_gradients_trace_under_expert_parallelism(report):
    """grouped_matmul's Hopper kernels (custom VJP) as the BF16 experts of the expert-parallel
    layer: the gradient program traces (its cotangents carry the expert-sharded weights' types)
    and holds no ragged_dot. Values: kernels_pallas/grouped_matmul's tests."""
    assert report["bf16_kernel_grads_lowered"]


def test_dispatch_chunk_bounds_xla_gpu_dense_ragged_dot_buffer():
    """On GPU, BF16 experts that XLA runs (no Hopper kernel: another GPU, f32 weights, or
    ``expert_matmul="xla"``) get chunks whose dense [E/n, chunk·k, D] f32 buffer fits
    GPU_DENSE_RAGGED_BYTES (Qwen3-30B-A3B at expert = 8: 16 local experts, k 8, D 2,048 ->
    1,024 tokens); the Hopper grouped_matmul kernels, FP8 experts (grouped kernels) and other
    platforms keep TOKEN_CHUNK."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractDevice, AbstractMesh

    from fp8rl_jax.models import moe_parallel as mp
    from kernels_pallas.backend import KernelImpls
    from kernels_pallas.quantize import quantize_weight

    w = jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16)
    h100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=h100)):
        assert mp.dispatch_chunk("gpu", w, 16, 8) == mp.TOKEN_CHUNK  # the Hopper kernels
        xla = KernelImpls(expert_matmul="xla")
        assert mp.dispatch_chunk("gpu", w, 16, 8, xla) == 1024
        w32 = jax.ShapeDtypeStruct((128, 2048, 768), jnp.float32)
        assert mp.dispatch_chunk("gpu", w32, 16, 8) == 1024  # f32: no kernel, dense XLA
    # The target here is the CPU (no Hopper kernel): the dense bound applies on "gpu".
    assert mp.dispatch_chunk("gpu", w, 16, 8) == 1024
    assert mp.GPU_DENSE_RAGGED_BYTES == 16 * 1024 * 8 * 2048 * 4
    assert mp.dispatch_chunk("gpu", w, 128, 8) == 128  # no expert parallelism: all 128 local
    assert mp.dispatch_chunk("gpu", jax.ShapeDtypeStruct((8, 64, 32), jnp.float32), 2, 2) == (
        mp.TOKEN_CHUNK
    )  # small experts: the dense buffer is small, the usual chunk
    assert mp.dispatch_chunk("tpu", w, 16, 8) == mp.TOKEN_CHUNK  # native ragged dot
    assert mp.dispatch_chunk(None, w, 16, 8) == mp.TOKEN_CHUNK
    q = quantize_weight(jnp.ones((2, 256, 128), jnp.float32))
    assert mp.dispatch_chunk("gpu", q, 16, 8) == mp.TOKEN_CHUNK  # FP8: the grouped kernel
