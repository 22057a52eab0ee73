"""The Hopper kernel's tile configurations (``mgpu_config.py``): legality, the SMEM they take as
Mosaic GPU counts it, and the per-shape default tiles. Pure Python: no kernel runs here."""

import dataclasses

import pytest

from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.fp8_matmul.mgpu_config import MgpuConfig


def test_smem_count_is_mosaic_gpus_count():
    """``smem_bytes`` against Mosaic GPU's own ``smem_bytes`` for these tiles (K=4096), read from
    the deviceless H100 compile; the last one is over the 232448 B budget and Mosaic rejects it."""
    count = lambda cfg, x_b, out_b, fused: mgpu.smem_bytes(cfg, 4096, x_b, out_b, fused)
    assert count(MgpuConfig(128, 128, 4), 1, 2, False) == 165952
    assert count(MgpuConfig(32, 64, 4, swap_ab=True), 1, 2, False) == 54336
    assert count(MgpuConfig(128, 128, 3), 2, 2, True) == 198704
    assert count(MgpuConfig(128, 128, 3), 2, 4, True) == 231472  # fused, f32 out: fits
    assert count(MgpuConfig(128, 128, 6), 1, 2, False) == 232544 > mgpu.SMEM_BYTES
    # the wide tiles (aot_check_wide_tiles.json: Mosaic's scratch + 8 B per barrier)
    assert count(MgpuConfig(128, 256, 3), 1, 2, False) == 215040 + 48
    assert count(MgpuConfig(128, 256, 3, cluster_m=2), 1, 2, False) == 215040 + 48  # cluster
    assert count(MgpuConfig(256, 128, 3), 1, 2, False) == 216064 + 48
    assert count(MgpuConfig(128, 256, 2), 1, 4, False) == 230400 + 32  # f32 out: 2 stages fit
    assert count(MgpuConfig(128, 256, 3), 1, 4, False) > mgpu.SMEM_BYTES
    assert mgpu.default_config(4096, 12288, 4096, fused=True).max_concurrent_steps == 3
    assert mgpu.default_config(4096, 12288, 4096).max_concurrent_steps == 3  # 128x256


@pytest.mark.parametrize(
    "m,n,k,out_b,tile",
    [  # (M, N, K, output bytes) -> (block_m, block_n, stages, swap_ab, cluster_m, overlap):
        # promotions under the wgmmas (128x128, 3 stages of two 128-K slices) on grids that run in
        # 2-CTA clusters (an even number of M tiles, >= 88 CTAs: 2/3 of 132 SMs) where 3 stages
        # fit; else 128x256 where its grid has >= 88 CTAs, 128x128 on smaller grids (perf_model.md)
        (4096, 4096, 4096, 2, (128, 128, 3, False, 2, True)),  # 512 CTAs
        (4096, 1024, 4096, 2, (128, 128, 3, False, 2, True)),  # 256 CTAs
        (4097, 1024, 4096, 2, (128, 256, 3, False, 1, False)),  # 33 M tiles: no cluster padding
        (2048, 1024, 4096, 2, (128, 128, 3, False, 2, True)),  # 128 CTAs
        (1024, 1024, 4096, 2, (128, 128, 4, False, 1, False)),  # 64 CTAs
        (256, 12288, 4096, 2, (128, 128, 3, False, 2, True)),  # 192 CTAs
        (256, 4096, 4096, 2, (128, 128, 4, False, 1, False)),  # 64 CTAs
        (128, 28672, 8192, 2, (128, 256, 3, False, 1, False)),  # one M tile
        (4096, 12288, 4096, 4, (128, 256, 2, False, 2, False)),  # F32 out: 3 overlap stages miss
        (4096, 4096, 384, 2, (128, 256, 4, False, 2, False)),  # 3 K slices: not two per step
        (4096, 4160, 4096, 2, (128, 64, 3, False, 2, True)),  # N % 128
        (64, 4096, 12288, 2, (64, 128, 3, True, 1, False)),  # decode: 3 two-slice stages
        # 128x256 where 128x128 would need a second wave of CTAs and 128x256 does not
        (384, 6144, 4096, 2, (128, 256, 3, False, 1, False)),  # 144 -> 72 CTAs (3 M tiles)
        (160, 10240, 8192, 2, (128, 128, 3, False, 2, True)),  # 160 CTAs in clusters
    ],
)
def test_default_tile_choice(m, n, k, out_b, tile):
    cfg = mgpu.default_config(m, n, k, out_itemsize=out_b)
    got = (cfg.block_m, cfg.block_n, cfg.max_concurrent_steps, cfg.swap_ab, cfg.cluster_m,
           cfg.overlap)  # fmt: skip
    assert got == tile
    assert mgpu.supports(m, k, n, cfg, fused=False, x_itemsize=1, out_itemsize=out_b) is None
    fused = mgpu.default_config(m, n, k, fused=True, out_itemsize=out_b)
    assert len(fused.wg_subtiles) == 1 and fused.cluster_m == 1  # no wide or cluster variant


def test_wide_tile_legality():
    legal = [MgpuConfig(128, 256), MgpuConfig(256, 128)]
    assert all(c.invalid() is None and len(c.wg_subtiles) == 2 for c in legal)
    for bad in (MgpuConfig(256, 256), MgpuConfig(64, 256), MgpuConfig(256, 64),
                MgpuConfig(32, 256, swap_ab=True)):  # fmt: skip
        assert bad.invalid() is not None, bad
    assert "fused" in mgpu.supports(4096, 4096, 4096, MgpuConfig(128, 256, 3), fused=True,
                                    x_itemsize=2, out_itemsize=2)  # fmt: skip
    assert MgpuConfig(128, 256, cluster_m=2).invalid() is None
    assert "cluster_m" in MgpuConfig(32, 64, swap_ab=True, cluster_m=2).invalid()
    assert "cluster_m" in MgpuConfig(128, 128, cluster_m=4).invalid()


def test_persistent_legality_and_snake_band():
    assert MgpuConfig(128, 256, 3, cluster_m=2, persistent=132).invalid() is None
    assert MgpuConfig(128, 128, persistent=5).invalid() is None
    for bad in (MgpuConfig(32, 64, swap_ab=True, persistent=132),  # decode
                MgpuConfig(32, 64, swap_ab=True, split_k=2, persistent=132),
                MgpuConfig(128, 128, cluster_m=2, persistent=5),  # not whole clusters
                MgpuConfig(128, 128, persistent=True),  # a CTA count, not a flag
                MgpuConfig(128, 128, persistent=-1)):  # fmt: skip
        assert "persistent" in bad.invalid(), bad
    assert "persistent" in mgpu.supports(4096, 4096, 4096, MgpuConfig(128, 128, 3, persistent=132),
                                         fused=True, x_itemsize=2, out_itemsize=2)  # fmt: skip
    # bands of M tiles whose x rows fit 24 MiB: all 16 cluster rows at M = K = 4096, 8 at K = 12288
    cfg = MgpuConfig(128, 256, 3, cluster_m=2, persistent=132)
    assert mgpu.snake_band(cfg, 4096, 4096) == 16
    assert mgpu.snake_band(cfg, 4096, 12288) == 8
    assert mgpu.snake_band(cfg, 256, 1 << 20) == 1


@pytest.mark.parametrize("m,n,k", [(4096, 12288, 4096), (4097, 2048, 4096), (2048, 4096, 4096)])
def test_persistent_is_off_by_default_and_a_tuning_candidate(m, n, k):
    """Predicted 1.002-1.025x (perf_model.md), no device run yet: off by default; the on-device
    autotuner times a persistent twin of each prefill tile (unfused prefill grids of > 132 CTAs)."""
    from kernels_pallas.fp8_matmul import tuning

    assert mgpu.default_config(m, n, k).persistent == 0
    assert mgpu.default_config(m, n, k, fused=True).persistent == 0
    specs = tuning.tuning_specs(m, n, k, "gpu")
    persistent = [cfg for _, _, cfg in specs if cfg is not None and cfg.persistent]
    assert persistent and all(cfg.persistent == 132 for cfg in persistent)
    assert all(name.endswith("/p132") for name, _, cfg in specs if cfg is not None and
               cfg.persistent)  # fmt: skip
    assert all(mgpu.supports(m, k, n, c, fused=False, x_itemsize=1, out_itemsize=2) is None
               for c in persistent)  # fmt: skip
    assert not [c for _, _, c in tuning.tuning_specs(16, n, k, "gpu") if c is not None and
                c.persistent]  # decode: swap-AB, no persistent twin  # fmt: skip


@pytest.mark.parametrize(
    "ctas,k_steps,wgs,split",
    [
        (32, 32, 2, 2),  # Qwen3-8B o_proj, 128-row tiles: 64 x 2 = 128 warpgroups (256 > 160)
        (32, 96, 2, 2),  # down_proj
        (8, 32, 2, 8),  # k/v_proj: a small grid splits down to 4-step chunks
        (4, 16, 2, 4),  # Qwen3-30B-A3B k/v_proj: 8 would leave 2-step chunks
        (40, 16, 2, 2),  # Qwen3-30B-A3B q|k|v fused: 160 warpgroups
        (48, 32, 2, 1),  # Qwen3-8B q|k|v fused: 192 would be past the cap
        (65, 32, 1, 2),  # 64-row tiles (N % 128): one warpgroup per CTA
        (8, 12, 2, 2),  # 12 K steps: 4 does not divide them
        (8, 8, 2, 2),  # 8 K steps: 4 would leave 2-step chunks
    ],
)
def test_decode_split_k_caps_warpgroups_and_keeps_chunks_long(ctas, k_steps, wgs, split):
    assert mgpu.decode_split_k(ctas, k_steps, wgs) == split


@pytest.mark.parametrize(
    "m,n,k,tile",
    [  # (M, N, K) -> (block_m, block_n, split_k) of the swap-AB decode tile (decode_config)
        (16, 4096, 4096, (32, 128, 2)),  # Qwen3-8B o_proj: 32 CTAs x 2
        (64, 4096, 4096, (64, 128, 2)),
        (64, 4096, 12288, (64, 128, 2)),  # down_proj
        (64, 6144, 4096, (64, 64, 1)),  # q|k|v fused: 48 unsplit 128-row CTAs; 96 of 64 rows
        (64, 10240, 8192, (64, 128, 1)),  # Llama-3-70B q|k|v fused: 80 CTAs
        (16, 8192, 8192, (32, 64, 1)),  # Llama-3-70B o_proj: 64 unsplit CTAs -> 128 of 64 rows
        (16, 24576, 4096, (32, 128, 1)),  # gate+up fused: 192 CTAs
        (16, 512, 2048, (32, 128, 4)),  # Qwen3-30B-A3B k/v_proj: 4 CTAs x 4 (4-step chunks)
        (16, 4160, 4096, (32, 64, 2)),  # N % 128: 64-row tiles only (65 CTAs x 2)
        (5, 4096, 4096, (32, 128, 2)),  # M rounded up to 32 (128-B TMA stages of x scales)
        # 65-256 rows where K splits (swap_default): every row is the wgmma N up to 128
        (128, 4096, 4096, (128, 128, 2)),  # Qwen3-8B o_proj: 32 prefill CTAs -> 64 split
        (96, 4096, 12288, (96, 128, 2)),  # down_proj
        (128, 1024, 4096, (128, 128, 8)),  # k/v_proj: 8 prefill CTAs -> 64
        (200, 1024, 4096, (128, 128, 4)),  # two M tiles of 128 rows: 16 CTAs x 4
    ],
)
def test_decode_config_prefers_two_warpgroup_tiles(m, n, k, tile):
    assert mgpu.swap_default(m, n, k)
    cfg = mgpu.default_config(m, n, k, k_slices=False, pdl=False)  # (the stages, the launch:
    assert cfg == mgpu.decode_config(m, n, k)  # test_two_slice_stages, test_dependent_launch)
    assert (cfg.block_m, cfg.block_n, cfg.split_k) == tile and cfg.swap_ab
    assert cfg.cluster_k == (cfg.split_k == 2)  # two chunks summed in their cluster
    assert mgpu.supports(m, k, n, cfg, fused=False, x_itemsize=1, out_itemsize=2) is None


@pytest.mark.parametrize(
    "m,n,k,ring",
    [  # (M, N, K) -> (k_slices, stages) of the default decode tile: two-slice stages where
        # 3-4 fit the SMEM (as many bytes in flight as 6-8 one-slice stages), else one slice
        (16, 4096, 4096, (2, 4)),  # o_proj 32x128, 2 chunks in-cluster: 185 KiB
        (64, 4096, 4096, (2, 3)),  # 64x128 in-cluster: 194 KiB (4 stages: 242 KiB)
        (16, 6144, 4096, (2, 4)),  # q|k|v fused, 32x64
        (16, 1024, 4096, (2, 4)),  # k/v_proj, split 8: chunks of 4 slices, 2 steps
        (128, 4096, 4096, (1, 4)),  # 128 rows, in-cluster: 3 two-slice stages miss by 64 KiB
        (16, 4096, 384, (1, 4)),  # 3 slices: no whole two-slice steps
        (16, 4096, 640, (1, 4)),  # 5 slices: odd
    ],
)
def test_two_slice_stages(m, n, k, ring):
    cfg = mgpu.default_config(m, n, k)
    assert (cfg.k_slices, cfg.max_concurrent_steps) == ring
    assert mgpu.supports(m, k, n, cfg, fused=False, x_itemsize=1, out_itemsize=2) is None
    one = mgpu.default_config(m, n, k, k_slices=False)
    assert one.k_slices == 1 and dataclasses.replace(cfg, k_slices=1,
                                                     max_concurrent_steps=4) == one  # fmt: skip
    assert cfg.k_block == 128 * cfg.k_slices
    # prefill tiles never take them (overlap is their two-slice step)
    assert mgpu.default_config(4096, n, k).k_slices == 1


def test_cluster_k_legality_and_smem():
    """In-cluster split-K: 2-8 chunks of a swap-AB tile; its SMEM as Mosaic GPU counts it (the
    deviceless H100 compile's scratch + 8 B per barrier, one more barrier per compute
    warpgroup): the received f32 accumulators replace the f32 partial tile by the output's."""
    count = lambda cfg, out_b: mgpu.smem_bytes(cfg, 4096, 1, out_b, False)
    assert count(MgpuConfig(32, 128, 4, True, 2, cluster_k=True), 2) == 107520 + 80
    assert count(MgpuConfig(32, 128, 4, True, 8, cluster_k=True), 2) == 205824 + 80
    assert count(MgpuConfig(64, 64, 4, True, 4, cluster_k=True), 4) == 132096 + 72
    assert count(MgpuConfig(128, 128, 4, True, 2, cluster_k=True), 2) == 231424 + 80
    assert MgpuConfig(32, 128, 4, True, 8, cluster_k=True).invalid() is None
    for bad in (MgpuConfig(32, 128, 4, True, 1, cluster_k=True),  # nothing to sum
                MgpuConfig(32, 128, 4, True, 16, cluster_k=True),  # past the portable 8 CTAs
                MgpuConfig(128, 128, 4, cluster_k=True)):  # fmt: skip
        assert "cluster_k" in bad.invalid(), bad
    # 128-row tiles with 2 chunks fit 4 stages (231504 B); F32 out needs 3
    assert mgpu.default_config(128, 4096, 4096).max_concurrent_steps == 4
    assert mgpu.default_config(128, 4096, 4096, out_itemsize=4).max_concurrent_steps == 3


@pytest.mark.parametrize(
    "m,n,k",
    [  # 65-256 rows that keep the prefill tile: K would not split (a wide grid already), or
        # more than 128 rows over a grid of more than a quarter of the SMs, or over 256 rows
        (128, 6144, 4096),  # q|k|v fused: 48 CTAs either way, the prefill K loop is shorter
        (128, 28672, 8192),
        (256, 4096, 4096),  # 2 x 32 prefill CTAs
        (65, 128, 384),  # 3 K steps: nothing to split
        (257, 512, 4096),
    ],
)
def test_rows_above_64_keep_the_prefill_tile_where_k_would_not_split(m, n, k):
    cfg = mgpu.default_config(m, n, k)
    assert not mgpu.swap_default(m, n, k) and not cfg.swap_ab and cfg.block_m >= 128


def test_swap_tiles_reach_128_rows():
    assert MgpuConfig(128, 128, swap_ab=True).invalid() is None
    assert MgpuConfig(96, 64, swap_ab=True, split_k=4).invalid() is None
    for bad in (160, 256, 100, 24, 8):  # 16-row multiples (the fused kernel's BF16 x stages)
        assert "multiple of 16" in MgpuConfig(bad, 128, swap_ab=True).invalid()
    for bad in (48, 16):  # FP8 x: 32-row multiples (128-B TMA stages of x scales)
        assert MgpuConfig(bad, 128, swap_ab=True).invalid() is None
        assert "multiple of 32" in mgpu.supports(
            bad,
            4096,
            4096,
            MgpuConfig(bad, 128, 4, True),
            fused=False,
            x_itemsize=1,
            out_itemsize=2,
        )
