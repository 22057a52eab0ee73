"""Ahead-of-time compile cases of ``fp8_matmul`` at real linear-layer shapes (``aot_check.py``).

Each row of ``LAYERS`` is one linear layer (K = in, N = out; the rollout weight is a QArray ``[N,
K]``) and the token counts M it is compiled at: decode (M <= 64, and 128-256 rows where K splits:
swap-AB on Hopper) and prefill. Every row runs for each entry of ``KINDS``: the Hopper kernel with
FP8 activations (a QArray) and with BF16 activations (the path ``quant.matmul`` takes: quantized
once by XLA, then the QArray kernel, at every M), the TPU kernel on v5e and v6e, and the XLA
fallback on H100 (``XLA_LAYERS``: FP8 GEMMs batched over K blocks for M <= 32, BF16 dequantize +
GEMM above). ``EXTRA`` adds E5M2 and F32-output cases (the F32 fused epilogue is the tightest SMEM
fit); ``TILES`` compiles non-default tile configurations the checks accept (both compute-warpgroup
counts, swap-AB from 32 to 128 rows, split-K, deep rings, N % 128 != 0, K tails of the ring, big TPU
tiles, the fused kernel: raw x with a non-swap config (opt-in) and the fused decode tiles), and
the tiles the dispatch's performance model picks over the rules on the H100's and the H200's
constants (``model_picks``).
Every case is one the support check accepts (``fp8_matmul`` raises for an explicit impl it
rejects), so compiling them all proves the check for these shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels_pallas.aot import AotCase
from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.fp8_matmul import pallas_tpu as tpu
from kernels_pallas.fp8_matmul.api import fp8_matmul
from kernels_pallas.qarray import QArray

DECODE_M = (1, 16, 64)
PREFILL_M = (128, 4096, 8192)
ALL_M = DECODE_M + PREFILL_M

# (model, layer, K, N, token counts M)
LAYERS = (
    ("Qwen3-8B", "q_proj|o_proj", 4096, 4096, ALL_M),
    ("Qwen3-8B", "k_proj|v_proj", 4096, 1024, (16, 128, 256, 4096)),
    ("Qwen3-8B", "gate|up_proj", 4096, 12288, ALL_M),
    ("Qwen3-8B", "down_proj", 12288, 4096, (16, 128, 4096)),
    ("Qwen3-30B-A3B", "q_proj", 2048, 4096, (16, 4096)),
    ("Qwen3-30B-A3B", "k_proj|v_proj", 2048, 512, (16, 4096)),
    ("Qwen3-30B-A3B", "o_proj", 4096, 2048, (16, 4096)),
    ("Llama-3-70B", "q_proj|o_proj", 8192, 8192, (16, 4096)),
    ("Llama-3-70B", "k_proj|v_proj", 8192, 1024, (16, 4096)),
    ("Llama-3-70B", "gate|up_proj", 8192, 28672, (1, 64, 8192)),
    ("Llama-3-70B", "down_proj", 28672, 8192, (16, 4096)),
    # the FP8 rollout's fused projections (``fp8rl_jax.models.fused``)
    ("Qwen3-8B", "q|k|v fused", 4096, 6144, (16, 64, 4096)),
    ("Qwen3-8B", "gate+up fused", 4096, 24576, (16, 4096)),
    ("Qwen3-30B-A3B", "q|k|v fused", 2048, 5120, (16, 4096)),
    ("Llama-3-70B", "q|k|v fused", 8192, 10240, (16, 64, 4096)),
)
# The XLA fallback on H100: one layer per model at every M (both of its methods).
XLA_LAYERS = (
    ("Qwen3-8B", "gate|up_proj", 4096, 12288, ALL_M),
    ("Qwen3-30B-A3B", "q_proj", 2048, 4096, (16, 4096)),
    ("Llama-3-70B", "gate|up_proj", 8192, 28672, (16, 4096)),
)
# (impl, target, activations): "fp8" a per-token QArray, "bf16" raw activations
KINDS = (
    ("pallas_mosaic_gpu", "h100", "fp8"),
    ("pallas_mosaic_gpu", "h100", "bf16"),
    ("pallas_tpu", "v5e", "fp8"),
    ("pallas_tpu", "v6e", "fp8"),
)
XLA_KINDS = (("xla", "h100", "fp8"),)
_Q8 = ("Qwen3-8B", "q_proj", 4096, 4096)
_G8 = ("Qwen3-8B", "gate|up_proj", 4096, 12288)
_E4, _E5, _BF, _F32 = "float8_e4m3fn", "float8_e5m2", "bfloat16", "float32"
# (impl, target, activations, FP8 format, output dtype, model, layer, K, N, M)
EXTRA = (
    ("pallas_mosaic_gpu", "h100", "fp8", _E5, _BF, *_Q8, 16),
    ("pallas_mosaic_gpu", "h100", "fp8", _E5, _BF, *_Q8, 4096),
    ("pallas_mosaic_gpu", "h100", "bf16", _E4, _F32, *_G8, 4096),  # quantize once, F32 out
    ("pallas_mosaic_gpu", "h100", "fp8", _E4, _F32, *_G8, 16),
    ("pallas_tpu", "v6e", "fp8", _E5, _BF, *_Q8, 16),
    ("pallas_tpu", "v5e", "bf16", _E4, _BF, *_G8, 4096),
)


_G, _T = mgpu.MgpuConfig, tpu.TpuConfig
_CK = functools.partial(_G, cluster_k=True)  # split-K summed in the CTA cluster
_S2 = functools.partial(_G, swap_ab=True, k_slices=2)  # decode tiles, two 128-K slices a step
# The 128x256 tile (3 stages) at the issue-21 prefill shapes (K, N) at M = 4096: Qwen3-8B q|o,
# k|v, gate|up, down; Llama-3-70B q|o, gate|up; DeepSeek-V3 (DeepGEMM's table) two GEMMs.
WIDE_KN = ((4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096), (8192, 8192),
           (8192, 28672), (1536, 24576), (16384, 7168))  # fmt: skip
WIDE = tuple(("pallas_mosaic_gpu", ("h100",), "fp8", _BF, k, n, 4096, _G(128, 256, 3))
             for k, n in WIDE_KN)  # fmt: skip
# The persistent grid (132 CTAs looping over snake-ordered tiles) on the earlier default prefill
# tile of Qwen3-8B gate|up, q|o and down at M = 4096 (128x256, 3 stages, 2-CTA clusters; down's
# K = 12288 makes two snake bands), and without clusters (the persistent grid takes no overlap).
_P = 132
_GO = functools.partial(_G, overlap=True)  # promotions under the wgmmas
PERSISTENT = tuple(
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, k, n, 4096, cfg)
    for k, n in ((4096, 12288), (4096, 4096), (12288, 4096))
    for cfg in (dataclasses.replace(mgpu.default_config(4096, n, k, overlap=False),
                                    persistent=_P),)  # fmt: skip
) + (
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 4096, _G(128, 256, 3, persistent=_P)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 4096, _G(128, 128, 4, persistent=_P)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 4096,
     _G(128, 128, 4, cluster_m=2, persistent=_P)),
)  # fmt: skip
# Dependent launch (MgpuConfig.pdl; the decode defaults above launch so) on other tiles: a
# 4-slice ring of F32 partials, the wide and clustered prefill tiles, and a persistent grid
# (no prefetch: the loop picks its first tile)
DEPENDENT = (
    ("pallas_mosaic_gpu", ("h100",), "fp8", _F32, 4096, 1024, 16,
     _S2(32, 128, 2, split_k=2, k_slices=4, pdl=True)),
) + tuple(
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 4096, dataclasses.replace(c, pdl=True))
    for c in (_G(128, 256, 3), _GO(128, 128, 3, cluster_m=2), _G(128, 128, 4, persistent=_P))
)  # fmt: skip
# The fused (BF16 x) decode kernel (mgpu_fused_swap; the default at M = 16 compiles in KINDS'
# "bf16" rows) on the other ways its warpgroups split the quantization: a 32-row slice each
# (two slices a step), row halves of 32 and of 16 rows (one slice a step), two slices each
# (four a step), one warpgroup alone, and with F32 out (yᵀ) and 2 chunks summed in-cluster
_PDL = functools.partial(_G, swap_ab=True, pdl=True)
FUSED = (
    ("pallas_mosaic_gpu", ("h100",), "bf16", _BF, 4096, 4096, 32, _PDL(32, 128, 3, k_slices=2)),
    ("pallas_mosaic_gpu", ("h100",), "bf16", _BF, 4096, 12288, 64, _PDL(64, 128, 4)),
    ("pallas_mosaic_gpu", ("h100",), "bf16", _BF, 4096, 4096, 20, _PDL(32, 128, 4)),
    ("pallas_mosaic_gpu", ("h100",), "bf16", _BF, 4096, 4096, 16, _PDL(16, 128, 2, k_slices=4)),
    ("pallas_mosaic_gpu", ("h100",), "bf16", _BF, 4096, 6144, 16, _PDL(16, 64, 4, k_slices=2)),
    ("pallas_mosaic_gpu", ("h100",), "bf16", _F32, 4096, 4096, 16, _PDL(16, 128, 4, k_slices=2)),
    (
        "pallas_mosaic_gpu",
        ("h100",),
        "bf16",
        _BF,
        4096,
        4096,
        32,
        _PDL(32, 128, 3, split_k=2, cluster_k=True, k_slices=2),
    ),
)
# Tile configurations the support check accepts beyond the per-shape defaults above:
# (impl, targets, activations, output dtype, K, N, M, config)
TILES = (
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4160, 4096, None),  # N % 128: 128x64
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 384, 4096, 256, None),  # 3 K steps < 4 stages
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 4097, None),  # M tail
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 6144, 384, None),  # 128x256: one wave
    ("pallas_mosaic_gpu", ("h100",), "fp8", "float16", 4096, 4096, 4096, None),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 4096, _G(64, 64)),  # one WG
    ("pallas_mosaic_gpu", ("h100",), "bf16", _BF, 4096, 4096, 64, _G(64, 128)),  # fused decode
    ("pallas_mosaic_gpu", ("h100",), "bf16", _BF, 4096, 4096, 4096, _G(128, 64, 3)),
    ("pallas_mosaic_gpu", ("h100",), "bf16", _F32, 4096, 12288, 4096, _G(128, 128, 3)),  # 226 KiB
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 32, _G(32, 128, 4, True)),  # 2 WGs
    ("pallas_mosaic_gpu", ("h100",), "fp8", _F32, 4096, 4096, 5, _G(32, 64, 4, True)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 5, _G(32, 128, 4, True)),  # y tiles
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 48, _G(64, 64, 6, True)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 16, _G(32, 64, 6, True)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 4096, _G(64, 64, 6)),  # deepest
    ("pallas_mosaic_gpu", ("h100",), "bf16", _BF, 4096, 4096, 16, _G(32, 64, 4, True)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 1024, 16, _G(32, 64, 4, True, 8)),  # split-K
    ("pallas_mosaic_gpu", ("h100",), "fp8", _F32, 4096, 1024, 64, _G(64, 64, 4, True, 2)),
    # swap-AB up to 128 rows as the wgmma N (65-256-row decode batches): F32 out, the y tile of
    # 96 rows with one warpgroup, two M tiles with split-K, and the deepest ring that fits
    ("pallas_mosaic_gpu", ("h100",), "fp8", _F32, 4096, 4096, 128, _G(128, 128, 4, True)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 96, _G(96, 64, 4, True)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 1024, 200, _G(128, 128, 4, True, 4)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 128, _G(128, 128, 5, True)),
    # split-K summed in the cluster (DSMEM): 2 and 8 chunks, one warpgroup, F32 out
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 16, _CK(32, 128, 4, True, 2)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 1024, 16, _CK(32, 128, 4, True, 8)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _F32, 4096, 1024, 64, _CK(64, 64, 4, True, 4)),
    # the decode defaults' deep-ring twins the autotuner times (tuning.DEEP_RING_STAGES): o_proj
    # M = 16 (2 chunks in-cluster, 148 KiB) and gate|up M = 64 (two warpgroups, 162 KiB)
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 16, _CK(32, 128, 6, True, 2)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 12288, 64, _G(64, 128, 6, True)),
    # two or four 128-K slices per pipeline step (k_slices): the deepest ring of 64x64 tiles
    # (12 slices in flight), four slices of 32x128, F32 partials of 8 K chunks, 128 rows
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 64, _S2(64, 64, 6)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 16, _S2(32, 128, 2, k_slices=4)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _F32, 4096, 1024, 16, _S2(32, 128, 4, split_k=8)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 128, _S2(128, 128, 2)),
    # the wide prefill tiles: 128x256 (f32 out: 2 stages, 230432 B of SMEM), 256x128
    ("pallas_mosaic_gpu", ("h100",), "fp8", _F32, 4096, 4096, 4096, _G(128, 256, 2)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 4097, _G(256, 128, 3)),  # M tail
    ("pallas_mosaic_gpu", ("h100",), "bf16", _BF, 8192, 28672, 4096, _G(256, 128, 3)),
    *WIDE,
    # 2-CTA clusters along M (weight tile multicast): explicit, 128x128 and F32 out
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 4096, _G(128, 128, 4, cluster_m=2)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _F32, 4096, 4096, 4096, _G(128, 256, 2, cluster_m=2)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 300, _G(128, 256, 3, cluster_m=2)),
    *PERSISTENT,
    # promotions under the wgmmas (two 128-K slices per step, x scales from GMEM): 3 stages of
    # 128x256 x and w tiles, the deepest that fits; 1 CTA, 64-column tiles; F32 out; an M tail
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 4096, 4096, 4096, _GO(128, 128, 3, cluster_m=2)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _F32, 4096, 2112, 4096, _GO(128, 64, 3, cluster_m=2)),
    ("pallas_mosaic_gpu", ("h100",), "fp8", _BF, 7168, 4096, 300, _GO(128, 128, 3)),
    *DEPENDENT,
    *FUSED,
    ("pallas_tpu", ("v5e", "v6e"), "fp8", _BF, 384, 256, 48, _T(block_m=32, block_k=256)),
    ("pallas_tpu", ("v5e", "v6e"), "fp8", _F32, 4096, 4096, 4096, _T(512, block_k=1024)),
    ("pallas_tpu", ("v5e", "v6e"), "fp8", _BF, 4096, 4096, 4096, _T(1024, block_k=2048)),
    ("pallas_tpu", ("v5e", "v6e"), "fp8", _BF, 4096, 4096, 16, _T(compute_dtype="float32")),
    ("pallas_tpu", ("v6e",), "fp8", _BF, 4096, 4096, 16, _T(compute_dtype="bfloat16")),
    ("pallas_tpu", ("v5e",), "fp8", _BF, 4096, 4096, 16, _T(pack=2)),  # pairs, upcast
    ("pallas_tpu", ("v5e", "v6e"), "fp8", _BF, 8192, 28672, 64, _T(block_n=2048)),
    ("pallas_tpu", ("v5e", "v6e"), "fp8", _BF, 4096, 4096, 4096, _T(1024, 2048, 512)),
    # v6e prefill's default is dequant_bf16; the exact per-group path stays available there,
    # and dequant_bf16 compiles on v5e too when asked for
    ("pallas_tpu", ("v6e",), "fp8", _BF, 4096, 4096, 4096, _T(compute_dtype="native")),
    ("pallas_tpu", ("v5e",), "fp8", _BF, 4096, 4096, 4096, _T(compute_dtype="dequant_bf16")),
    ("pallas_tpu", ("v6e",), "fp8", _F32, 4096, 12288, 300, _T(compute_dtype="dequant_bf16")),
)


def _operands(m: int, k: int, n: int, x_kind: str, fmt: str = "float8_e4m3fn"):
    """(x, w_q) as ShapeDtypeStructs: x [M, K] (QArray with 1x128 groups, or BF16), w [N, K]."""
    sds, f8, f32 = jax.ShapeDtypeStruct, jnp.dtype(fmt), jnp.float32
    if x_kind == "fp8":
        x = QArray(sds((m, k), f8), sds((m, -(-k // 128)), f32), (128,), jnp.bfloat16)
    else:
        x = sds((m, k), jnp.bfloat16)
    w = QArray(sds((n, k), f8), sds((-(-n // 128), -(-k // 128)), f32), (128, 128), jnp.bfloat16)
    return x, w


def _call(x, w_q, *, impl: str, out_dtype: str, config=None):
    return fp8_matmul(x, w_q, out_dtype=jnp.dtype(out_dtype), impl=impl, config=config)


def _tile_cases() -> list[AotCase]:
    out = []
    for impl, targets, x_kind, out_dtype, k, n, m, cfg in TILES:
        fn = functools.partial(_call, impl=impl, out_dtype=out_dtype, config=cfg)
        label = f"tiles K={k} N={n} M={m} {x_kind} x, {out_dtype} out, {cfg or 'default config'}"
        for target in targets:
            out.append(AotCase("fp8_matmul", impl, target, label, fn, _operands(m, k, n, x_kind)))
    return out


# The tiles the dispatch's performance model picks over the rules
# (``tile_choice.dispatch_config``), on the H100's and the H200's constants: each distinct pick
# once, at the first (chip, M, layer) of ``LAYERS`` that takes it (the H100's picks at the
# layers' own M compile in the default rows above too)
PICK_M = (16, 64, 96, 128, 192, 256, 384, 512, 1024, 2048)


def model_picks() -> list[tuple[str, str, str, int, int, int, mgpu.MgpuConfig]]:
    """(chip, model, layer, K, N, M, tile) of each distinct model-picked tile (FP8 x, BF16 out)."""
    from kernels_pallas.fp8_matmul import mgpu_config, tile_choice

    seen = {}
    for chip in ("h100", "h200"):
        for m in PICK_M:
            for model, layer, k, n, _ in LAYERS:
                cfg = tile_choice.dispatch_config(m, n, k, chip=chip)
                if cfg != mgpu_config.default_config(m, n, k) and cfg not in seen:
                    seen[cfg] = (chip, model, layer, k, n, m, cfg)
    return list(seen.values())


# Raw BF16 x at 17-64 rows runs the fused kernel where the model picks it
# (``tile_choice.fused_wins``), on the tile ``dispatch_config(fused=True)`` ranks fastest: each
# distinct (tile, rows padded or not) once, at these M (24 and 48: x padded to the row tile)
FUSED_PICK_M = (24, 32, 48, 64)


def fused_picks() -> list[tuple[str, str, str, int, int, int, mgpu.MgpuConfig]]:
    """(chip, model, layer, K, N, M, tile) of each distinct fused-kernel default at 17-64 rows
    (raw BF16 x, BF16 out)."""
    from kernels_pallas.fp8_matmul import tile_choice

    seen = {}
    for chip in ("h100", "h200"):
        for m in FUSED_PICK_M:
            for model, layer, k, n, _ in LAYERS:
                if not tile_choice.fused_wins(m, n, k, chip=chip):
                    continue
                cfg = tile_choice.dispatch_config(m, n, k, fused=True, chip=chip)
                key = (cfg, m % cfg.block_m == 0)
                if key not in seen:
                    seen[key] = (chip, model, layer, k, n, m, cfg)
    return list(seen.values())


def _pick_cases() -> list[AotCase]:
    from kernels_pallas.fp8_matmul import tile_choice

    out = []
    for kind, picks in (("", model_picks()), (" fused", fused_picks())):
        for chip, model, layer, k, n, m, cfg in picks:
            fn = functools.partial(_call, impl="pallas_mosaic_gpu", out_dtype=_BF, config=cfg)
            label = f"model pick{kind} ({chip}) {model} {layer} K={k} N={n} M={m} " \
                    f"{tile_choice.name(cfg)}"  # fmt: skip
            x_kind = "bf16" if kind else "fp8"
            out.append(AotCase("fp8_matmul", "pallas_mosaic_gpu", "h100", label, fn,
                               _operands(m, k, n, x_kind)))  # fmt: skip
    return out


def _case(impl, target, x_kind, fmt, out_dtype, model, layer, k, n, m) -> AotCase:
    phase = "decode" if m <= 256 else "prefill"
    tags = [x_kind + " x"]
    tags += [] if fmt == "float8_e4m3fn" else ["e5m2"]
    tags += [] if out_dtype == "bfloat16" else [f"{out_dtype} out"]
    label = f"{model} {layer} K={k} N={n} M={m} ({phase}, {', '.join(tags)})"
    fn = functools.partial(_call, impl=impl, out_dtype=out_dtype)
    return AotCase("fp8_matmul", impl, target, label, fn, _operands(m, k, n, x_kind, fmt))


def _cases(layers, kinds) -> list[AotCase]:
    return [
        _case(impl, target, x_kind, "float8_e4m3fn", "bfloat16", model, layer, k, n, m)
        for impl, target, x_kind in kinds
        for model, layer, k, n, ms in layers
        for m in ms
    ]


def cases() -> list[AotCase]:
    """Every (kernel, target, activation kind) at every layer shape, the XLA fallback, extras."""
    extra = [_case(*e) for e in EXTRA] + _tile_cases() + _pick_cases()
    return _cases(LAYERS, KINDS) + _cases(XLA_LAYERS, XLA_KINDS) + extra
