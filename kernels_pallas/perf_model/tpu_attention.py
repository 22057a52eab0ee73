"""TPU decode / paged attention in the performance model (``tpu.py`` has the assumptions).

Both kernels run grid (B, splits, steps); a step online-softmaxes ``slots`` cache slots of all
KV heads of one row: per KV head a ``[G, C] x [C, bs]`` and a ``[G, bs] x [bs, C]`` MXU dot, the
FP8 -> BF16 upcast of K and V, the per-head strided slice ``k_ref[0, :, kh, :]`` (one sublane out
of each packed (K, C) tile: counted as one VPU op per element, an assumption) and ~8 softmax ops
per score. Rows are full (every table entry live), as the AOT shapes' budgets. Baseline: a
BF16-cache kernel at the HBM roofline (``ratio`` > 1: faster than any BF16-cache kernel could
be); ``detail`` also gives the fraction of HBM bandwidth the FP8 kernel is predicted to reach.
"""

from __future__ import annotations

import math

from kernels_pallas.perf_model import tpu as model

SOFTMAX_OPS = 8  # VPU ops per score: scale, mask, max, sub, exp2, sum, rescale, cast


def _step(chip: model.TpuChip, slots: int, n_kv: int, group: int, c: int, kv_bytes: int,
          dynamic: bool) -> model.Step:  # fmt: skip
    rows = max(group, 8)
    mxu = n_kv * (model.mxu_cycles(chip, rows, c, slots) + model.mxu_cycles(chip, rows, slots, c))
    upcast = chip.upcast_ops if kv_bytes == 1 else 0
    valu = n_kv * (2 * slots * c * (upcast + 1) + SOFTMAX_OPS * rows * slots)
    dma = 2 * slots * n_kv * (c * kv_bytes + (4 if dynamic else 0))
    return model.Step(mxu, valu, vst_vregs=n_kv * rows * c / model.VREG_ELEMS, dma_bytes=dma)


def predict(chip: model.TpuChip, kernel: str, shape: str, b: int, live: int, slots: int,
            n_kv: int, group: int, c: int, kv_bytes: int,
            dynamic: bool) -> model.Prediction:  # fmt: skip
    """``slots`` cache slots per grid step (block_s, or pages x page size)."""
    steps = b * math.ceil(live / slots)
    step = _step(chip, slots, n_kv, group, c, kv_bytes, dynamic)
    secs, bound = model.grid_time(chip, steps, step, step.dma_bytes, 0)
    bf16_bytes = 2 * b * live * n_kv * c * 2
    base = bf16_bytes / chip.hbm_bytes_per_s
    hbm_frac = (bf16_bytes * kv_bytes / 2) / chip.hbm_bytes_per_s / secs
    detail = f"slots/step={slots} HBM {hbm_frac:.0%}"
    return model.Prediction(kernel, chip.name, shape, secs, base, bound, steps, detail)


def slots_per_step(op: str, s: int, page_size: int = 128) -> int:
    """Cache slots a grid step takes now: block_s (dense), pages x page size (paged)."""
    if op == "paged_attention":
        from kernels_pallas.paged_attention import pallas_tpu as paged

        return page_size * paged.pages_per_step(page_size, s // page_size)
    return next(x for x in (512, 256, 128) if s % x == 0)


def rows() -> list[dict]:
    """Dense decode (block_s 512 before and now) and paged (one page a step before, 512 slots
    a step now) with FP8 (static scales) caches."""
    from kernels_pallas.decode_attention.aot_cases import SHAPES as DENSE
    from kernels_pallas.paged_attention.aot_cases import SHAPES as PAGED
    from kernels_pallas.perf_model.tpu_table import pair

    out = []
    for chip in model.CHIPS.values():
        for name, b, s, h, k in DENSE:
            shape = f"{name} B={b} S={s} H/K={h}/{k} fp8 cache"
            bs = slots_per_step("decode_attention", s)
            p = predict(chip, "decode_attention", shape, b, s, bs, k, h // k, 128, 1, False)
            out.append(pair(p, p))
        for name, b, _, y, w, h, k in PAGED:
            shape = f"{name} B={b} pages {w}x{y} H/K={h}/{k} fp8 cache"
            args = (chip, "paged_attention", shape, b, w * y)
            before = predict(*args, y, k, h // k, 128, 1, False)
            now = predict(*args, slots_per_step("paged_attention", w * y, y), k, h // k, 128, 1,
                          False)  # fmt: skip
            out.append(pair(before, now))
    return out
