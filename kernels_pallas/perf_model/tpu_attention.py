"""TPU decode / paged attention in the performance model (``tpu.py`` has the assumptions).

Both kernels run grid (B, splits, steps); a step online-softmaxes ``slots`` cache slots of all
KV heads of one row: per unit of ``pair`` KV heads side by side (``head_pairs``: 2 where the
count is even) a ``[pair·G, pair·C] x [pair·C, bs]`` and a ``[pair·G, bs] x [bs, pair·C]`` MXU
dot (a 128-deep head alone fills half a 256x256 v6e MXU), the FP8 -> BF16 upcast of K and V,
the per-head strided slice ``k_ref[0, :, kh, :]`` (one sublane out of each packed (K, C) tile:
counted as one VPU op per element, an assumption), for a pair the lane concatenation (one more
op per element) and ~8 softmax ops per score. Rows are full (every table entry live), as the
AOT shapes' budgets. Baseline: a BF16-cache kernel at the HBM roofline (``ratio`` > 1: faster
than any BF16-cache kernel could be); ``detail`` also gives the fraction of HBM bandwidth the
FP8 kernel is predicted to reach.
"""

from __future__ import annotations

import math

from kernels_pallas.perf_model import tpu as model

SOFTMAX_OPS = 8  # VPU ops per score: scale, mask, max, sub, exp2, sum, rescale, cast


def _step(chip: model.TpuChip, slots: int, n_kv: int, group: int, c: int, kv_bytes: int,
          dynamic: bool, pair: int = 1) -> model.Step:  # fmt: skip
    """One grid step over ``n_kv / pair`` units of ``pair`` KV heads side by side (one
    ``[pair · G, pair · C] x [pair · C, bs]`` and one ``[pair · G, bs] x [bs, pair · C]`` dot
    each; a paired tile costs one more VPU copy per element: the lane concatenation)."""
    units, rows, width = n_kv // pair, max(pair * group, 8), pair * c
    mxu = units * (model.mxu_cycles(chip, rows, width, slots)
                   + model.mxu_cycles(chip, rows, slots, width))  # fmt: skip
    upcast = chip.upcast_ops if kv_bytes == 1 else 0
    copies = 1 + (pair > 1)  # the per-head strided slice, and the concatenation
    valu = n_kv * 2 * slots * c * (upcast + copies) + units * SOFTMAX_OPS * rows * slots
    dma = 2 * slots * n_kv * (c * kv_bytes + (4 if dynamic else 0))
    return model.Step(mxu, valu, vst_vregs=units * rows * width / model.VREG_ELEMS,
                      dma_bytes=dma)  # fmt: skip


def predict(chip: model.TpuChip, kernel: str, shape: str, b: int, live: int, slots: int,
            n_kv: int, group: int, c: int, kv_bytes: int, dynamic: bool,
            pair: int | None = None) -> model.Prediction:  # fmt: skip
    """``slots`` cache slots per grid step (block_s, or pages x page size); ``pair``: KV heads
    per dot (default: what the kernels run, ``decode_attention.pallas_tpu.head_pairs``)."""
    from kernels_pallas.decode_attention.pallas_tpu import head_pairs

    pair = head_pairs(n_kv) if pair is None else pair
    steps = b * math.ceil(live / slots)
    step = _step(chip, slots, n_kv, group, c, kv_bytes, dynamic, pair)
    secs, bound = model.grid_time(chip, steps, step, step.dma_bytes, 0)
    bf16_bytes = 2 * b * live * n_kv * c * 2
    base = bf16_bytes / chip.hbm_bytes_per_s
    hbm_frac = (bf16_bytes * kv_bytes / 2) / chip.hbm_bytes_per_s / secs
    detail = f"slots/step={slots}{f' {pair} heads/dot' if pair > 1 else ''} HBM {hbm_frac:.0%}"
    return model.Prediction(kernel, chip.name, shape, secs, base, bound, steps, detail)


def slots_per_step(op: str, s: int, page_size: int = 128) -> int:
    """Cache slots a grid step takes now: block_s (dense), pages x page size (paged)."""
    if op == "paged_attention":
        from kernels_pallas.paged_attention import pallas_tpu as paged

        return page_size * paged.pages_per_step(page_size, s // page_size)
    return next(x for x in (512, 256, 128) if s % x == 0)


def rows() -> list[dict]:
    """Dense decode (block_s 512; before: one KV head per dot, now two side by side) and paged
    (before: one page a step, one head per dot; now 512 slots a step, two heads per dot) with
    FP8 (static scales) caches."""
    from kernels_pallas.decode_attention.aot_cases import SHAPES as DENSE
    from kernels_pallas.paged_attention.aot_cases import SHAPES as PAGED
    from kernels_pallas.perf_model.tpu_table import pair

    out = []
    for chip in model.CHIPS.values():
        for name, b, s, h, k in DENSE:
            shape = f"{name} B={b} S={s} H/K={h}/{k} fp8 cache"
            bs = slots_per_step("decode_attention", s)
            args = (chip, "decode_attention", shape, b, s, bs, k, h // k, 128, 1, False)
            out.append(pair(predict(*args, pair=1), predict(*args)))
        for name, b, _, y, w, h, k in PAGED:
            shape = f"{name} B={b} pages {w}x{y} H/K={h}/{k} fp8 cache"
            args = (chip, "paged_attention", shape, b, w * y)
            before = predict(*args, y, k, h // k, 128, 1, False, pair=1)
            now = predict(*args, slots_per_step("paged_attention", w * y, y), k, h // k, 128, 1,
                          False)  # fmt: skip
            out.append(pair(before, now))
    return out
