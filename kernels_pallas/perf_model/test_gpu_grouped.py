"""The GPU model of the grouped FP8 kernel (the FP8 rollout's MoE experts, ``gpu_grouped``):
its tiles, bytes, XLA launches and BF16 baseline by hand, the SASS claim it rests on (the grouped
kernel's K loop is the dense kernel's), and the two-warpgroup decode tiles it justified."""

import math

import pytest

from kernels_pallas.grouped_fp8_matmul import pallas_mosaic_gpu as kernel
from kernels_pallas.perf_model import common, gpu, gpu_grouped


def test_grouped_fp8_tiles_bytes_launches_and_baseline_by_hand():
    """Qwen3-30B-A3B down (K 768, N 2048) at 512 rows (B = 64, top-8) over 128 experts on the
    H100: 32-row swap-AB tiles, ``cdiv(512, 32) + 128 - 1`` = 143 row tiles x 16 N tiles."""
    rows, e, k, n, chip = 512, 128, 768, 2048, "h100"
    p = gpu_grouped.predict_grouped_fp8(chip, rows, e, k, (n,))
    assert kernel.default_config(rows, (n,), k, e) == kernel.MgpuConfig(32, 128, 4, True)
    assert p.impl.startswith("gfp8_swap_32x128")
    assert p.terms["tiles"] == 143 * 16
    w = 128 * n * k + 128 * (n // 128) * (k // 128) * 4  # every expert has rows
    x = rows * k + rows * (k // 128) * 4
    assert p.bytes == w + x + 143 * 32 * n * 2  # the tile outputs, BF16
    bw = common.CHIPS[chip].hbm_bytes_per_s
    # x's scales padded and transposed (512 rows are whole tiles: x itself is not padded), the
    # gather reading and writing rows x N, three launches
    extra = (2 * rows * (k // 128) * 4 + 2 * rows * n * 2) / bw + 3 * gpu.LAUNCH_S
    assert p.terms["extra_s"] == pytest.approx(extra, rel=1e-12)
    c = common.CHIPS[chip]
    t_mma = 2 * rows * n * k / (c.bf16_flops_per_s * gpu.BF16_GEMM_EFF)
    t_bw = (128 * n * k * 2 + rows * (k + n) * 2) / (bw * gpu.BF16_GEMM_BW_EFF) + gpu.FILL_S
    assert p.baseline_s == pytest.approx(max(t_mma, t_bw) + gpu.LAUNCH_S, rel=1e-12)
    cal = gpu.KERNEL_CALIBRATION["mm_decode"]  # 4 rows per expert: decode-sized groups
    kernel_s = cal * max(p.terms["compute_s"], p.terms["hbm_s"])
    assert p.time_s == pytest.approx(kernel_s + gpu.LAUNCH_S + extra, rel=1e-12)


def test_the_regime_not_the_tile_picks_the_calibration():
    """An unswapped 128x128 tile on decode-sized groups is calibrated as the decode GEMMs were
    measured (weight-streaming), a swap-AB tile on prefill-sized groups as the prefill ones."""
    args = ("h100", 512, 128, 2048, (768, 768))
    wide = gpu_grouped.predict_grouped_fp8(*args, config=kernel.MgpuConfig(128, 128, 4))
    assert wide.terms["calibration"] == gpu.KERNEL_CALIBRATION["mm_decode"]
    big = ("h100", 65536, 128, 2048, (768, 768))
    swap = gpu_grouped.predict_grouped_fp8(*big, config=kernel.MgpuConfig(64, 128, 4, True))
    assert swap.terms["calibration"] == gpu.KERNEL_CALIBRATION["mm_prefill"]


@pytest.mark.parametrize(
    "grouped,dense",
    [("gfp8_swap_32x64", "mm_swap_32x64"), ("gfp8_swap_64x64", "mm_swap_64x64"),
     ("gfp8_swap_32x128", "mm_swap_32x128"), ("gfp8_swap_64x128", "mm_swap_64x128"),
     ("gfp8_128x128", "mm_qarray_128x128"), ("gfp8_128x256", "mm_qarray_128x256"),
     ("gfp8_256x128", "mm_qarray_256x128")],
)  # fmt: skip
def test_grouped_kernel_runs_the_dense_k_loop(grouped, dense):
    """The committed SASS profiles: the grouped kernel's K loop (its tile's expert and row
    block read once, before the loop) is the dense kernel's on the same tile, within two
    instructions, with its registers and MMAs, so the dense kernels' measured calibration
    carries over."""
    profs = gpu.load_profiles()
    g, d = profs[grouped], profs[dense]
    assert g["registers"] == d["registers"] and g["spill_bytes"] == 0
    gm, dm = g["main_loop"], d["main_loop"]
    assert (gm["mma"], gm["mma_shape"]) == (dm["mma"], dm["mma_shape"])
    assert abs(gm["total"] - dm["total"]) <= 2


def test_two_warpgroup_decode_tiles_are_never_predicted_slower():
    """``default_config``'s decode tiles with 128 weight rows per CTA (168 registers, two CTAs
    an SM) against the 64 of before (255 registers, one CTA): never slower, on either chip, and
    far faster where many experts each stream a few rows' weights."""
    rows = [r for r in gpu_grouped.design_changes() if r[0] == gpu_grouped.GROUPED_TILE_CHANGE]
    assert len(rows) == 2 * 10  # 10 decode cases (2 layers x 5 row counts) x 2 chips
    gain = {}
    for _, before, after in rows:
        assert "x64 " in before.impl and "x128 " in after.impl
        assert after.time_s <= before.time_s * (1 + 1e-9), (after.label, after.chip)
        gain[(after.label, after.chip)] = before.time_s / after.time_s
    assert gain[("Qwen3-30B-A3B down rows=2048", "h100")] >= 1.4
    assert gain[("Qwen3-30B-A3B gate+up rows=2048", "h200")] >= 1.5
    assert math.prod(gain.values()) ** (1 / len(gain)) >= 1.2


def test_prefill_tiles_store_rows_by_hand():
    """Qwen3-30B-A3B down at 65,536 rows (8,192 prompt tokens, top-8) on the H100: wide 128x256
    tiles, ``cdiv(65536, 128) + 127`` = 639 row tiles x 8 N tiles; y written once (no tile
    outputs, no gather: two launches around the kernel); the 127 group boundaries each cut a
    tile of both their groups, whose cut warpgroup stores 64 x 256 BF16 through the unswizzled
    tile at 8 bank wavefronts per 128 B."""
    rows, e, k, n, chip = 65536, 128, 768, 2048, "h100"
    p = gpu_grouped.predict_grouped_fp8(chip, rows, e, k, (n,))
    assert p.impl == "gfp8_128x256 + 2 fusions" and p.terms["tiles"] == 639 * 8
    w = 128 * n * k + 128 * (n // 128) * (k // 128) * 4
    x = rows * k + rows * (k // 128) * 4
    assert p.bytes == w + x + rows * n * 2
    bw = common.CHIPS[chip].hbm_bytes_per_s
    extra = 2 * rows * (k // 128) * 4 / bw + 2 * gpu.LAUNCH_S  # the scales' pad/transpose only
    assert p.terms["extra_s"] == pytest.approx(extra, rel=1e-12)
    c = common.CHIPS[chip]
    per_cta = 64 * 256 * 2 * 8 / 128 / c.clock_hz
    ragged = 2 * 127 * 8 * per_cta / (c.cores * p.terms["ctas_per_sm"])
    cfg = kernel.default_config(rows, (n,), k, e)
    got = gpu_grouped.ragged_epilogue_s(chip, cfg, 128, 8, p.terms["ctas_per_sm"])
    assert got == pytest.approx(ragged)
    # the same tile stored whole and gathered: the tile outputs' and the gather's bytes more
    old = gpu_grouped.predict_grouped_fp8(chip, rows, e, k, (n,), ragged=False)
    assert old.bytes - p.bytes == (639 * 128 - rows) * n * 2
    gather = 2 * rows * n * 2 / bw + gpu.LAUNCH_S
    assert old.terms["extra_s"] - p.terms["extra_s"] == pytest.approx(gather, rel=1e-9)


def test_prefill_change_is_predicted_faster_and_beats_bf16():
    """Ragged stores and wide tiles at 65,536 rows: faster than the 128x128 tiles written whole
    and gathered, on both chips and both layers, and past the BF16 grouped GEMM."""
    rows = [r for r in gpu_grouped.design_changes() if r[0] == gpu_grouped.GROUPED_PREFILL_CHANGE]
    assert len(rows) == 2 * 2  # 65,536 rows (2 layers) x 2 chips
    for _, before, after in rows:
        assert before.impl.startswith("gfp8_128x128") and after.impl.startswith("gfp8_128x256")
        assert after.time_s < 0.85 * before.time_s and after.ratio > 1.0, (after.label, after.chip)


def test_bf16_gmm_by_hand_and_against_its_one_warpgroup_past():
    """``grouped_matmul``'s forward, Qwen3-30B-A3B gate|up on one device (32,768 rows, all live,
    128 experts): 128x256 tiles of two warpgroups, ``cdiv(32768, 128) + 127`` = 383 row tiles x
    3 N tiles of 32 steps of 64; all rows written once into y (no gather), the tile map's one
    launch around it; faster than the one-warpgroup 128x128 kernel with its gather."""
    m, e, k, n, chip = 32768, 128, 2048, 768, "h100"
    p = gpu_grouped.predict_grouped_bf16(chip, m, m, e, k, n, "fwd")
    assert p.impl == "gmm_bf16_128x256 (fwd)" and p.terms["tiles"] == 383 * 3
    assert p.bytes == 383 * 128 * k * 2 + e * k * n * 2 + m * n * 2
    assert p.terms["extra_s"] == pytest.approx(gpu.LAUNCH_S)
    prof = gpu.load_profiles()["gmm_bf16_128x256"]
    loop = gpu.Loop(nwg=2, threads=384, wg_flops=2 * 64 * 256 * 64, fp8=False, waits=0,
                    step_bytes=(128 + 256) * 64 * 2, stages=3)  # fmt: skip
    t, terms = gpu.grid_time(chip, loop, prof, 383 * 3, k // 64)
    t += gpu_grouped.ragged_epilogue_s(chip, kernel_bf16().gmm_default(k, n), e, 3,
                                       terms["ctas_per_sm"])  # fmt: skip
    assert p.terms["compute_s"] == pytest.approx(t, rel=1e-12)
    old = gpu_grouped.predict_grouped_bf16(chip, m, m, e, k, n, "fwd", one_wg=True)
    assert old.impl == "gmm_bf16_128x128_1wg (fwd)" and old.time_s > 1.4 * p.time_s
    # every BF16 design-change row: faster on both chips, forward and input gradient
    rows = [r for r in gpu_grouped.design_changes() if r[0] == gpu_grouped.GMM_CHANGE]
    assert len(rows) == len(gpu_grouped.GROUPED_SHAPES) * 2 * 2
    assert all(after.time_s < before.time_s for _, before, after in rows)


def test_tgmm_by_hand_and_against_its_one_warpgroup_f32_past():
    """tgmm, Qwen3-30B-A3B gate|up on one device (all 32,768 rows live, 128 experts): 128x256
    tiles of two warpgroups, 128 x 16 K tiles x 3 N tiles, each over a group's 256 rows in
    ``ceil((32768 + 128 x 63) / 64 / 128)`` = 5 row blocks on average; dw written once in BF16,
    no cast. Before: one warpgroup on 128x128 tiles writing f32 that XLA read and cast (6 bytes
    an element more)."""
    args = ("h100", 32768, 32768, 128, 2048, 768, "wgrad")
    now = gpu_grouped.predict_grouped_bf16(*args)
    assert now.impl == "tgmm_bf16_128x256 (wgrad)" and now.terms["tiles"] == 128 * 16 * 3
    dw = 128 * 2048 * 768
    assert now.bytes == (32768 + 128 * 64) * (2048 + 768) * 2 + dw * 2
    assert now.terms["extra_s"] == pytest.approx(gpu.LAUNCH_S)  # the group bounds
    prof = gpu.load_profiles()["tgmm_bf16_128x256"]
    loop = gpu.Loop(nwg=2, threads=384, wg_flops=2 * 64 * 256 * 64, fp8=False, waits=0,
                    step_bytes=(128 + 256) * 64 * 2, stages=3)  # fmt: skip
    t, _ = gpu.grid_time("h100", loop, prof, 128 * 16 * 3, 5)
    assert now.terms["compute_s"] == pytest.approx(t, rel=1e-12)
    old = gpu_grouped.predict_grouped_bf16(*args, one_wg=True, f32_dw=True)
    assert old.impl == "tgmm_bf16_128x128_1wg (wgrad)" and old.bytes - now.bytes == dw * 2
    bw = common.CHIPS["h100"].hbm_bytes_per_s
    assert old.terms["extra_s"] - now.terms["extra_s"] == pytest.approx(dw * 6 / bw, rel=1e-9)
    rows = [r for r in gpu_grouped.design_changes() if r[0] == gpu_grouped.TGMM_CHANGE]
    assert len(rows) == len(gpu_grouped.GROUPED_SHAPES) * 2
    assert all(after.time_s < 0.5 * before.time_s for _, before, after in rows)
    # an f32 dw keeps the square tiles (an f32 128x256 output tile leaves two stages)
    f32 = gpu_grouped.predict_grouped_bf16(*args, f32_dw=True)
    assert f32.impl == "tgmm_bf16_128x128 (wgrad)" and f32.time_s > now.time_s


def kernel_bf16():
    from kernels_pallas.grouped_matmul import pallas_mosaic_gpu

    return pallas_mosaic_gpu


def test_compare_puts_bench_moe_grouped_rows_beside_the_model(tmp_path):
    """A GPU run's bench_moe file: its Hopper grouped FP8 rows (gate+up as two equal stacks)
    beside the model's time; its other arms (BF16, XLA, quantizing) have no row."""
    import json

    from kernels_pallas.perf_model import compare

    common_ = dict(model="Qwen3-30B-A3B", experts=128, tokens=64, rows=512)
    rows = [
        dict(common_, layer="gate+up", k=2048, n=1536, arm="grouped_fp8:pallas_mosaic_gpu",
             median_us=150.0),
        dict(common_, layer="down", k=768, n=2048, arm="grouped_fp8:pallas_mosaic_gpu",
             median_us=90.0),
        dict(common_, layer="down", k=768, n=2048, arm="bf16_ragged_dot", median_us=900.0),
        dict(common_, layer="gate+up", k=2048, n=1536, arm="bf16_grouped:pallas_mosaic_gpu",
             median_us=300.0),
        dict(common_, layer="down", k=768, n=2048, arm="grouped_fp8:pallas_mosaic_gpu+quant",
             median_us=95.0),
    ]  # fmt: skip
    bench = tmp_path / "bench_moe.json"
    bench.write_text(json.dumps(dict(meta=dict(device_kind="NVIDIA H100 80GB HBM3"),
                                     results=rows)))  # fmt: skip
    lines = compare.rows_beside([str(bench)])
    assert len(lines) == 2 + 3
    up = gpu_grouped.predict_grouped_fp8("h100", 512, 128, 2048, (768, 768)).time_s * 1e6
    assert (
        "gate+up rows=512 E=128 K=2048 N=1536 | grouped_fp8:pallas_mosaic_gpu | 150.0" in lines[2]
    )
    assert f"| {up:.1f} | {150.0 / up:.2f} |" in lines[2]
    down = gpu_grouped.predict_grouped_fp8("h100", 512, 128, 768, (2048,)).time_s * 1e6
    assert f"| 90.0 | - | {down:.1f} | {90.0 / down:.2f} |" in lines[3]
    # the BF16 gmm forward: one call per stack, then their outputs concatenated (one fusion)
    gmm = gpu_grouped.predict_grouped_bf16("h100", 512, 512, 128, 2048, 768, "fwd").time_s
    cat = 2 * 512 * 1536 * 2 / common.CHIPS["h100"].hbm_bytes_per_s + gpu.LAUNCH_S
    bf16 = (2 * gmm + cat) * 1e6
    assert "bf16_grouped:pallas_mosaic_gpu | 300.0" in lines[4]
    assert f"| {bf16:.1f} | {300.0 / bf16:.2f} |" in lines[4]
