"""Dependent launch of the Hopper fp8_matmul decode tiles (``MgpuConfig.pdl``,
``kernels_pallas/dependent_launch.py``): the default rule, the compiled prologue (the H100 SASS
recorded by ``profile_gpu``: weight prefetches, then the wait, then the first load), and on a
device the bits of a chain of GEMMs launched dependent against the same chain launched after
each predecessor completes."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.fp8_matmul import mgpu_config
from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.perf_model.sass_profiles import SASS_JSON
from kernels_pallas.quantize import quantize_activations, quantize_weight

E4M3 = jnp.float8_e4m3fn


@pytest.mark.parametrize("m,n,k", [(16, 4096, 4096), (64, 6144, 4096), (128, 1024, 4096),
                                   (1, 28672, 8192)])  # fmt: skip
def test_decode_tiles_launch_dependent(m, n, k):
    cfg = mgpu.default_config(m, n, k)
    assert cfg.swap_ab and cfg.pdl
    plain = mgpu.default_config(m, n, k, pdl=False)
    assert not plain.pdl and dataclasses.replace(cfg, pdl=False) == plain
    assert mgpu.supports(m, k, n, cfg, fused=False, x_itemsize=1, out_itemsize=2) is None
    # prefill tiles and the fused prefill kernel launch as before; the fused decode tile (raw
    # x, in-kernel quantization) is a decode tile too
    assert not mgpu.default_config(4096, n, k).pdl
    assert not mgpu.default_config(4096, n, k, fused=True).pdl
    fused = mgpu.default_config(m, n, k, fused=True)  # swap-AB at M <= 64
    assert fused.pdl == (fused.swap_ab and mgpu_config.decode_pdl()) and fused.swap_ab == (m <= 64)


def test_the_compiled_prologue_prefetches_the_first_ring_and_waits_before_any_load():
    """The H100 SASS of the o_proj decode default (32x128, two K chunks in-cluster, 4 stages of
    two 128-K slices) launched dependent: 8 L2 prefetches of weight tiles, one grid dependency
    wait before every global load or store, no early trigger; the K loop of the same tile
    launched plainly, instruction for instruction."""
    with open(SASS_JSON) as f:
        variants = json.load(f)["variants"]
    pdl, plain = (variants[n]["kernels"][0] for n in ("mm_swap_32x128_k2c_s2_pdl",
                                                      "mm_swap_32x128_k2c_s2"))  # fmt: skip
    assert pdl["dependent_launch"] == dict(waits=1, prefetches=4 * 2, accesses_before_wait=0,
                                           triggers=0)  # fmt: skip
    assert plain.get("dependent_launch") is None
    assert pdl["main_loop"]["by_op"] == plain["main_loop"]["by_op"]
    assert (pdl["registers"], pdl["spill_bytes"]) == (plain["registers"], 0)


@pytest.mark.gpu
def test_a_dependent_chain_on_hopper_equals_the_plain_chain():
    """On the device: GEMM -> XLA quantization -> GEMM, each decode GEMM launched dependent on
    the kernel before it, gives the bits of the same chain launched plainly: the second GEMM
    reads the activations its predecessor has just written only after the wait."""
    m, k, n = 16, 4096, 4096
    kx, kw, kv = jax.random.split(jax.random.key(23), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w1, w2 = (quantize_weight(jax.random.normal(key, (k, n), jnp.float32), (128, 128), E4M3)
              for key in (kw, kv))  # fmt: skip

    def chain(pdl):
        cfg = mgpu.default_config(m, n, k, pdl=pdl)

        @jax.jit
        def run(x):
            y = mgpu.fp8_matmul_mgpu(quantize_activations(x, 128, E4M3), w1, config=cfg)
            return mgpu.fp8_matmul_mgpu(quantize_activations(y, 128, E4M3), w2, config=cfg)

        return np.asarray(run(x), np.float32)

    assert mgpu.default_config(m, n, k).pdl
    np.testing.assert_array_equal(chain(True), chain(False))
