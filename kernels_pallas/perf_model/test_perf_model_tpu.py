"""The TPU performance model against hand-computed cycle counts and times, and its table."""

import pytest

from kernels_pallas.perf_model import tpu as model
from kernels_pallas.perf_model import tpu_table

V5E, V6E = model.CHIPS["v5e"], model.CHIPS["v6e"]


def test_clocks_follow_from_the_published_peaks():
    # 197e12 / (4 MXUs * 2 * 128^2) and 918e12 / (4 * 2 * 256^2)
    assert V5E.clock_hz == pytest.approx(1.503e9, rel=1e-3)
    assert V6E.clock_hz == pytest.approx(1.751e9, rel=1e-3)


def test_mxu_cycles_count_weight_tiles_and_streamed_rows():
    # [512, 128] x [128, 1024]: v5e 1 x 8 tiles of 128^2, 512 rows each, over 4 MXUs
    assert model.mxu_cycles(V5E, 512, 128, 1024) == 1 * 8 * 512 / 4
    # v6e: 1 x 4 tiles of 256^2 (the 128-deep contraction fills half of each)
    assert model.mxu_cycles(V6E, 512, 128, 1024) == 1 * 4 * 512 / 4
    # 32 rows cannot hide the 256-cycle weight load; two groups packed into one 256-deep dot
    # cost what one 128-deep dot does
    one = model.mxu_cycles(V6E, 32, 128, 1024)
    assert one == 4 * 256 / 4 and model.mxu_cycles(V6E, 64, 256, 1024) == one


def test_xla_baseline_at_4096_cubed_on_v5e():
    # 32 x 32 tiles x 4096 rows / 4 MXUs at 1.503 GHz, at 84%: the guide's XLA figure
    want = 32 * 32 * 4096 / 4 / V5E.clock_hz / 0.84
    assert model.xla_bf16_matmul_s(V5E, 4096, 4096, 4096) == pytest.approx(want)
    assert want == pytest.approx(2 * 4096**3 / (197e12 * 0.84), rel=1e-3)


def test_grid_time_adds_overhead_per_step_and_the_exposed_first_dma():
    step = model.Step(mxu_cycles=0, valu_ops=0, vst_vregs=0, dma_bytes=1e6)
    secs, bound = model.grid_time(V6E, 10, step, first_bytes=1e6, last_bytes=0)
    dma = 1e6 / (1640e9 * 0.85)
    assert secs == pytest.approx(10 * (0.35e-6 + dma) + dma)
    assert bound == "hbm"


def test_table_before_and_now():
    rows = tpu_table.table()
    assert {r["kernel"] for r in rows} == {
        "fp8_matmul", "grouped_fp8_matmul", "decode_attention", "paged_attention"
    }  # fmt: skip
    assert all(r["now_us"] > 0 and r["baseline_us"] > 0 for r in rows)
    mm = {(r["target"], r["shape"]): r for r in rows if r["kernel"] == "fp8_matmul"}
    decode = mm[("v6e", "Qwen3-8B q_proj|o_proj M=16 K=4096 N=4096")]
    assert "pack=2 fp8->mxu" in decode["detail_now"] and decode["steps_now"] == 4
    assert decode["steps_before"] == 256  # 32 N tiles x 8 K tiles of the wave-2 kernel
    assert decode["ratio_now"] > 5 * decode["ratio_before"]


def test_grouped_row_tile_of_four_mean_groups_is_never_predicted_slower(monkeypatch):
    """``pallas_tpu.tile_m``: a power of two >= 4x the mean group size (32 rows at 1-4 rows
    per expert, 64 / 128 at 16 / 32, 512 at 512). Where the weights stream per tile (N and K
    tiled: ``block_k=1024``), at every Qwen3-30B-A3B case on v5e and v6e it streams fewer
    expert weights than a tile of the mean group size, and at 32 rows per expert it is
    predicted > 1.3x faster."""
    from kernels_pallas.grouped_fp8_matmul import pallas_tpu as tpu

    cfg = tpu.TpuConfig()
    assert [tpu.tile_m(r, 128, cfg) for r in (8, 512, 2048, 4096, 65536)] == [32, 32, 64, 128, 512]
    streamed = tpu.TpuConfig(block_k=1024)
    now = {(r["target"], r["shape"]): r["now_us"] for r in tpu_table.grouped_rows(streamed)}
    monkeypatch.setattr(tpu, "TILE_PER_MEAN_GROUP", 1)
    mean = {(r["target"], r["shape"]): r["now_us"] for r in tpu_table.grouped_rows(streamed)}
    assert len(now) == 24 and now.keys() == mean.keys()
    for key, t in now.items():
        assert t <= mean[key] * (1 + 1e-9), key
    faster = [mean[key] / t for key, t in now.items() if "rows=4096 " in key[1]]
    assert len(faster) == 4 and min(faster) > 1.3


def test_grouped_weight_reuse_is_the_default_and_never_predicted_slower():
    """The default plan keeps each stack's whole (N, K) weight as one block (``weight_reuse``):
    at every Qwen3-30B-A3B case on v5e and v6e predicted no slower than the streamed plan of
    before (N tiles <= 1024, K steps of 1024): >= 1.05x faster everywhere, >= 1.2x from 512
    rows (1.06-1.50x); the row tile is capped at 128 on v5e (no FP8 MXU: upcast MXU work
    binds)."""
    from kernels_pallas.grouped_fp8_matmul import pallas_tpu as tpu

    p = tpu.plan(65536, 2048, (768, 768), 128, None, fp8_mxu=False)
    assert (p.block_m, p.block_n, p.block_k) == (128, 768, 2048) and tpu.weight_reuse(
        p, 2048, (768, 768)
    )
    p6 = tpu.plan(65536, 768, (2048,), 128, None, fp8_mxu=True)
    assert (p6.block_m, p6.block_n, p6.block_k) == (512, 2048, 768)
    assert not tpu.weight_reuse(tpu.plan(512, 2048, (768, 384), 128, None, fp8_mxu=True),
                                2048, (768, 384))  # stacks of unequal N: streamed  # fmt: skip
    now = {(r["target"], r["shape"]): r["now_us"] for r in tpu_table.grouped_rows()}
    streamed = tpu_table.grouped_rows(tpu.TpuConfig(block_k=1024))
    was = {(r["target"], r["shape"]): r["now_us"] for r in streamed}
    assert len(now) == 24 and now.keys() == was.keys()
    for key, t in now.items():
        assert was[key] / t >= 1.05, key
        if not any(f"rows={r} " in key[1] for r in (8, 64)):
            assert was[key] / t >= 1.2, key
