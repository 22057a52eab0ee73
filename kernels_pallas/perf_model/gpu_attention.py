"""GPU performance model of the decode and paged attention kernels (Mosaic GPU, swap-AB and
unswapped, FP8 and BF16 caches) against a BF16-cache attention at a stated share of HBM: the
step formula, waves and launch of ``gpu.py`` with the kernels' SASS profiles and their own
load round trip (``ATTN_LOAD_LATENCY_S``)."""

from __future__ import annotations

import math

from kernels_pallas.perf_model.common import CHIPS, Prediction
from kernels_pallas.perf_model.gpu import (
    LAUNCH_S,
    PDL_LAUNCH_S,
    Loop,
    calibration,
    finish,
    grid_time,
    load_profiles,
    nearest_profile,
)

# The decode attention kernels' ring (``emit_pipeline`` in the compute warpgroup: a slot's next
# load issued after the step that read it): their measured step times give one load round trip
# for the BF16 (2 stages) and FP8 (3 stages) kernels alike, ~3.5 us (``calibration
# .attention_latency``: stages x measured step - chain, the swap-AB kernels' 9 rows), under
# the load of 128-264 CTAs streaming at 3.1-4.4 TB/s; the GEMMs' dedicated TMA warpgroup sees
# ``DRAM_LATENCY_S``.
ATTN_LOAD_LATENCY_S = 3.5e-6
BF16_ATTN_BW_EFF = 0.85  # BF16-cache decode attention: FlashInfer / FlashMLA-class kernels
# reach 85-90% of HBM (FlashMLA: 3000 GB/s of 3350 on H800)


def bf16_attention_s(chip: str, b: int, s: int, n_kv: int, d: int) -> float:
    nbytes = 2 * b * s * n_kv * d * 2
    return nbytes / (CHIPS[chip].hbm_bytes_per_s * BF16_ATTN_BW_EFF) + LAUNCH_S


def predict_attention(chip: str, op: str, b: int, s: int, h: int, n_kv: int, d: int,
                      cache: str = "fp8", *, splits: int | None = None, label: str = "",
                      in_program: bool = False, swap_ab: bool = True, block_s: int | None = None,
                      stages: int | None = None, pdl: bool = True) -> Prediction:  # fmt: skip
    """Decode attention (dense, or paged with 64-slot pages) over full rows of ``s`` slots;
    ``in_program``: the chunks' XLA combine is a launch the program's count holds. ``swap_ab``
    (the kernels' default): the query group is the wgmma N (``mgpu_swap.swap_n``), its MMAs
    ``[block_s, N]``, K upcast in registers and Pᵀ [N, block_s] f16 through SMEM; else a
    64-row M tile. ``block_s`` (dense only; None: the default 64): 128 is the autotuner's wide
    FP8 candidate (profile ``decode_fp8_bs128``; the 64-slot kernel's calibration factor);
    ``stages`` (None: ``default_stages``): the K/V ring's depth (the same profile: the loop's
    instructions do not depend on it; its SMEM, compiled at the default depth, grows or shrinks
    by the K/V tiles of each other stage). ``pdl`` (the kernels' default): launched dependent,
    ``PDL_LAUNCH_S`` for the launch (``kernels_pallas/dependent_launch``)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.decode_attention import mgpu_swap
    from kernels_pallas.decode_attention import pallas_mosaic_gpu as dense
    from kernels_pallas.decode_attention.common import DecodeBlocks

    fp8, depth_given = cache == "fp8", stages is not None
    kv_dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    k_sds = jax.ShapeDtypeStruct((b, s, n_kv, d), kv_dtype)
    if op == "paged_attention":
        from kernels_pallas.paged_attention import pallas_mosaic_gpu as paged

        bs, stages = 64, stages or dense.default_stages(kv_dtype, swap_ab)
        splits = splits if splits is not None else paged.default_splits(b, s // bs, n_kv)
        name = "paged_fp8" if fp8 else "decode_bf16"
    else:
        bl = dense.resolve_blocks(DecodeBlocks(block_s, splits, stages, swap_ab), None, k_sds)
        bs, stages, splits = bl.block_s, bl.num_stages, bl.num_splits
        name = "decode_fp8" if fp8 else "decode_bf16"
    name += "" if swap_ab else "_unswapped"
    name += "_bs128" if fp8 and swap_ab and bs == 128 else ""
    prof = nearest_profile(name, load_profiles())
    kv_b = 1 if fp8 else 2
    rows = mgpu_swap.swap_n(h // n_kv) if swap_ab else 64  # the query side of every MMA
    # the ring's depth sets the CTA's SMEM (CTAs per SM): the profile's, compiled at the default
    # depth, plus or minus the K/V tiles of each other stage
    extra_stages = stages - dense.default_stages(kv_dtype, swap_ab)
    prof = dict(prof, smem_bytes=prof["smem_bytes"] + extra_stages * 2 * bs * d * kv_b)
    # FP8: read the K and V tiles, write their f16 copies (swapped: V's only, K stays in
    # registers as the A operand); swapped: the Pᵀ store (unswapped, P stays in registers)
    upcast = 2 * bs * d + (1 if swap_ab else 2) * bs * d * 2 if fp8 else 0
    upcast += rows * bs * 2 if swap_ab else 0
    loop = Loop(nwg=1, threads=128, wg_flops=2 * 2 * rows * bs * d, fp8=False, waits=2,
                step_bytes=2 * bs * d * kv_b, stages=stages, smem_bytes=upcast,
                load_latency_s=ATTN_LOAD_LATENCY_S)  # fmt: skip
    steps = math.ceil(s / bs / splits)
    t, terms = grid_time(chip, loop, prof, n_kv * b * splits, steps)
    terms = dict(terms, splits=splits, block_s=bs, registers=prof["registers"],
                 smem_alloc=prof["smem_bytes"])  # fmt: skip
    extra = 0.0 if splits == 1 else b * h * d * 4 * splits * 2 / CHIPS[chip].hbm_bytes_per_s
    extra += LAUNCH_S if splits > 1 and not in_program else 0.0  # the XLA combine of chunks
    nbytes = 2 * b * s * n_kv * d * kv_b
    base = f"BF16-cache decode attention ({BF16_ATTN_BW_EFF:.0%} of HBM)"
    impl = f"{name} J={splits}" + (f" {stages} stages" if depth_given else "")
    base_s = bf16_attention_s(chip, b, s, n_kv, d)
    label = label or f"B={b} S={s} H/K={h}/{n_kv}"
    scale = calibration("attn_fp8" + ("" if swap_ab else "_unswapped")) if fp8 else 1.0
    return finish(op, label, chip, impl, t, terms, nbytes, 4 * b * h * s * d, base, base_s, extra,
                  scale, PDL_LAUNCH_S if pdl else LAUNCH_S)  # fmt: skip
