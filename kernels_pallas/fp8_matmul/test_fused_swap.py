"""The fused (BF16 x) decode kernel (``mgpu_fused_swap``): raw x quantized in-kernel on swap-AB
tiles. In GPU interpret mode it equals the quantize-once path (``act_quantize`` formula, then the
QArray kernel) bit for bit, on every way the compute warpgroups split the quantization; the
support check names what it refuses; the default takes it at M = 16 and at 17-64 rows where the
performance model picks it (``tile_choice.fused_wins``); the SASS reader
finds its K loop past the mbarrier wait between the warpgroups. Its hardware compile (registers,
spills, SMEM, the row-amax layouts of 16 and 32 rows) is ``aot_cases.py``'s; its speed
``perf_model``'s (``mm_fused_swap_*``)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.fp8_matmul import MgpuConfig, api, fp8_matmul, tuning
from kernels_pallas.fp8_matmul import mgpu_config as mc
from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.perf_model import sass
from kernels_pallas.quantize import quantize_activations, quantize_weight


def _operands(m, k, n, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = (jax.random.normal(kx, (m, k), jnp.float32) * 3.0).astype(jnp.bfloat16)
    return x, quantize_weight(jax.random.normal(kw, (k, n), jnp.float32))


def _quantize_once(x, wq, cfg):
    """The QArray kernel on x quantized by ``quantize_activations`` (the reference formula),
    on ``cfg``'s tile with its rows raised to the 32-row multiple FP8 x needs (the rows' sums
    are independent of the tile's height)."""
    rows = -(-cfg.block_m // mc.SWAP_ROW_ALIGN) * mc.SWAP_ROW_ALIGN
    once = dataclasses.replace(cfg, block_m=rows)
    return mgpu.fp8_matmul_mgpu(quantize_activations(x), wq, interpret=True, config=once)


# (M, N, K, config): how the warpgroups split the quantization (mgpu_fused_swap._units)
CASES = [
    # two compute warpgroups, two slices a step: one 16-row slice each (the M = 16 default)
    (16, 256, 512, MgpuConfig(16, 128, 3, True, k_slices=2)),
    # one slice a step: each warpgroup the half of its 32 rows (16) / 64 rows (32)
    (32, 256, 512, MgpuConfig(32, 128, 3, True)),
    (40, 128, 512, MgpuConfig(64, 128, 3, True)),
    # four slices a step: two each; and K split over CTAs (f32 partials summed by XLA)
    (16, 128, 1024, MgpuConfig(16, 128, 2, True, k_slices=4)),
    (16, 128, 1024, MgpuConfig(16, 128, 3, True, split_k=2, k_slices=2)),
    # one compute warpgroup (64 weight rows): it quantizes every slice itself
    (8, 128, 512, MgpuConfig(16, 64, 3, True, k_slices=2)),
    # K chunks summed in the cluster (interpret mode: each warpgroup quantizes every slice,
    # mgpu_fused_swap.shared)
    (32, 256, 1024, MgpuConfig(32, 128, 3, True, split_k=2, cluster_k=True, k_slices=2)),
]


@pytest.mark.parametrize("m,n,k,cfg", CASES, ids=lambda v: str(v) if isinstance(v, int) else "")
def test_fused_swap_equals_quantize_once_bit_for_bit(m, n, k, cfg):
    x, wq = _operands(m, k, n, seed=m + n + k)
    assert mc.fused_refuses(cfg) is None and api._fused(x, cfg, n, k)
    y = fp8_matmul(x, wq, impl="pallas_mosaic_gpu", config=cfg, interpret=True)
    ref = _quantize_once(x, wq, cfg)[:m]
    assert y.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ref, np.float32))


def test_default_takes_the_fused_kernel_at_sixteen_rows():
    """Raw x at M = 16: the fused 16-row tile (no act_quantize launch, no padding to 32 rows),
    equal to the quantize-once path's output; below, x would be padded to the tile (a launch
    as costly as the one saved); at 17-64 rows the model decides per shape and chip (on the
    H100 Qwen3-8B q|o_proj fused at 32 rows); above, x is quantized once."""
    assert [api.fused_default(m, 4096, 4096, "h100") for m in (1, 8, 15, 16, 17, 32, 64, 4096)] \
        == [False, False, False, True, False, True, False, False]  # fmt: skip
    x, wq = _operands(16, 512, 256, seed=3)
    cfg = mgpu.default_config(16, 256, 512, fused=True)
    assert (cfg.block_m, cfg.swap_ab, cfg.pdl) == (16, True, mc.decode_pdl())
    y = fp8_matmul(x, wq, impl="pallas_mosaic_gpu", interpret=True)
    assert "quantize_activations_triton" not in str(jax.make_jaxpr(
        lambda a: fp8_matmul(a, wq, impl="pallas_mosaic_gpu", interpret=True))(x))  # fmt: skip
    once = fp8_matmul(api.quantize_once(x, wq, interpret=True), wq, impl="pallas_mosaic_gpu",
                      interpret=True)[:16]  # fmt: skip
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(once, np.float32))


@pytest.mark.parametrize("m", [32, 64])
def test_default_takes_the_model_picked_fused_kernel_above_sixteen_rows(m):
    """Raw x at 32 / 64 rows on a shape the model fuses on the H100 (the CPU's chip): the
    default runs the fused kernel on ``dispatch_config(fused=True)``'s tile (at 64 rows the
    model's 64x128 split in 4, not the rules' 64x64), with no act_quantize launch, equal to
    the quantize-once path bit for bit."""
    from kernels_pallas.fp8_matmul import tile_choice

    n, k = 256, 512
    assert api.fused_default(m, n, k) and tile_choice.fused_wins(m, n, k, chip="h100")
    x, wq = _operands(m, k, n, seed=m)
    fn = lambda a: fp8_matmul(a, wq, impl="pallas_mosaic_gpu", interpret=True)  # noqa: E731
    assert "quantize_activations_triton" not in str(jax.make_jaxpr(fn)(x))
    once = fp8_matmul(api.quantize_once(x, wq, interpret=True), wq, impl="pallas_mosaic_gpu",
                      interpret=True)[:m]  # fmt: skip
    np.testing.assert_array_equal(np.asarray(fn(x), np.float32), np.asarray(once, np.float32))


def test_fused_swap_takes_f16_x_too():
    """F16 x (the other 16-bit dtype ``fp8_matmul`` quantizes in-kernel) through the fused
    default at M = 16 equals the quantize-once path bit for bit."""
    x, wq = _operands(16, 512, 256, seed=7)
    x = x.astype(jnp.float16)
    y = fp8_matmul(x, wq, impl="pallas_mosaic_gpu", interpret=True)
    once = fp8_matmul(api.quantize_once(x, wq, interpret=True), wq, impl="pallas_mosaic_gpu",
                      interpret=True)[:16]  # fmt: skip
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(once, np.float32))


def test_fused_swap_support_names_what_it_refuses():
    ok = lambda cfg, fused=True: mgpu.supports(  # noqa: E731
        16, 4096, 4096, cfg, fused=fused, x_itemsize=2 if fused else 1, out_itemsize=2
    )
    assert ok(MgpuConfig(16, 128, 4, True, k_slices=2)) is None
    # FP8 x keeps 32-row multiples (the ring's 128-B stages of x scales)
    assert "multiple of 32" in ok(MgpuConfig(16, 128, 4, True, k_slices=2), fused=False)
    # 48 rows: no row-amax layout; 16 rows split in halves of 8: neither
    assert "16, 32 or 64 rows" in ok(MgpuConfig(48, 128, 3, True))
    assert "got 8" in ok(MgpuConfig(16, 128, 4, True))
    assert "multiple of 16" in MgpuConfig(24, 128, 4, True).invalid()
    # BF16 x stages are twice the FP8 ones: the SMEM check counts them
    assert "SMEM" in ok(MgpuConfig(64, 128, 4, True, k_slices=2))


def test_fused_swap_smem_is_mosaics_count():
    """``smem_bytes`` = Mosaic GPU's scratch (the H100 compiles of
    ``perf_model/sass_profiles.json``: 16x128, 4 two-slice stages, 2 K chunks in-cluster:
    187,392 B; one warpgroup: 107,520 B) + 8 B per barrier, as for the other tiles
    (``test_mgpu_config``)."""
    cluster = MgpuConfig(16, 128, 4, True, 2, cluster_k=True, k_slices=2)
    one_wg = MgpuConfig(16, 64, 4, True, k_slices=2)
    assert mc.smem_bytes(cluster, 4096, 2, 2, True) == 187392 + 8 * (2 * 4 + 2 + 2)
    assert mc.smem_bytes(one_wg, 4096, 2, 2, True) == 107520 + 8 * (2 * 4)


def test_autotuner_times_raw_x_as_it_runs():
    """With raw x the tuner's default is the fused tile and every candidate is legal as the
    kernel ``fp8_matmul`` runs for it (fused where the fused kernel takes the config)."""
    specs = tuning.tuning_specs(16, 4096, 4096, "gpu", raw_x=True)
    cfgs = [c for _, impl, c in specs if impl == "pallas_mosaic_gpu"]
    assert cfgs[0] == mgpu.default_config(16, 4096, 4096, fused=True)
    for c in cfgs:
        fused = mc.fused_refuses(c) is None
        assert mgpu.supports(16, 4096, 4096, c, fused=fused, x_itemsize=2 if fused else 1,
                             out_itemsize=2) is None  # fmt: skip


def test_sass_loops_skip_a_wait_retry_past_the_exit():
    """ptxas puts an mbarrier wait's retry after the kernel's EXIT, branching back into the K
    loop: that span is no loop (it would hide the K loop, whose back edge comes first)."""
    text = "\n".join(
        f"/*{a:04x}*/ {op} ;"
        for a, op in (
            (0x10, "NOP"),
            (0x20, "QGMMA.64x16x32.F32.E4M3.E4M3 R0, gdesc[UR4], R0"),
            (0x30, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R1"),
            (0x40, "@!P0 BRA 0x90"),
            (0x50, "QGMMA.64x16x32.F32.E4M3.E4M3 R0, gdesc[UR4], R0"),
            (0x60, "@P1 BRA 0x10"),
            (0x70, "EXIT"),
            (0x90, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R1"),
            (0xA0, "BRA 0x40"),
        )
    )
    instrs = sass.parse_sass(text)
    assert sass.loops(instrs) == [(0x10, 0x60)]
    assert sass.main_loop(instrs).mma == 2
