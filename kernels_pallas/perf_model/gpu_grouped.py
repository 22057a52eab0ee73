"""GPU performance model of ``grouped_matmul``'s Hopper kernels (the BF16 MoE experts of the
scoring and training passes) against XLA:GPU's dense ``ragged_dot``: the step formula, waves and
assumptions of ``gpu.py``, with the kernels' own SASS profiles (``profile_gpu.py``)."""

from __future__ import annotations

import math

from kernels_pallas.perf_model.common import CHIPS, GPU_CHIPS, Case, Prediction
from kernels_pallas.perf_model.gpu import (
    BF16_GEMM_EFF,
    LAUNCH_S,
    Loop,
    bf16_gemm_s,
    finish,
    grid_time,
    load_profiles,
)


def dense_ragged_dot_s(chip: str, m: int, k: int, n: int, e: int, pass_: str) -> float:
    """XLA:GPU's ``ragged_dot`` (and its gradients): dense over the groups, every one of the
    buffer's ``m`` rows times every one of the ``e`` weights (``pallas_mosaic_gpu.py``), at the
    BF16 GEMM efficiencies: the forward and dgrad are ``[e·m, ·]`` GEMMs, the wgrad ``e``
    GEMMs ``[k, m] x [m, n]``."""
    if pass_ == "wgrad":
        return bf16_gemm_s(chip, e * k, n, m)
    return bf16_gemm_s(chip, e * m, n if pass_ == "fwd" else k, k if pass_ == "fwd" else n)


def predict_grouped_bf16(chip: str, m: int, live: int, e: int, k: int, n: int, pass_: str,
                         label: str = "") -> Prediction:  # fmt: skip
    """``grouped_matmul``'s Hopper kernels (128x128 output tiles, 64-deep steps, 4 stages) for
    one pass over a dispatch buffer of ``m`` rows of which ``live`` belong to the ``e`` groups
    (``fwd``: ``[m, k] x [e, k, n]``; ``dgrad``: ``[m, n] x [e, k, n]ᵀ``; ``wgrad``:
    ``[e, k, n]``). Live tiles are the bound ``cdiv(live, 128) + e - 1`` (each group boundary
    splits a row block); dead tiles exit at once (not modelled). The XLA around the kernels:
    padding x to whole row blocks (fwd/dgrad, when M is not a multiple of 128), the output row
    gather, and the f32 -> BF16 cast of dw."""
    bm = bn = 128
    bk, stages = 64, 4
    c = CHIPS[chip]
    bw = c.hbm_bytes_per_s
    name = "tgmm_bf16_128x128" if pass_ == "wgrad" else (
        "gmm_bf16_128x128_t" if pass_ == "dgrad" else "gmm_bf16_128x128")  # fmt: skip
    prof = load_profiles()[name]
    loop = Loop(nwg=1, threads=128, wg_flops=2 * bm * bn * bk, fp8=False, waits=0,
                step_bytes=(bm + bn) * bk * 2, stages=stages)  # fmt: skip
    if pass_ == "wgrad":
        ctas = e * (k // bm) * (n // bn)
        steps = math.ceil((live + e * (bk - 1)) / bk / e)  # a group's row blocks, on average
        extra = e * k * n * (4 + 2) / bw + LAUNCH_S  # the f32 dw read and cast to BF16
        hbm = (live + e * bk) * (k + n) * 2 + e * k * n * 4
        flops = 2 * live * k * n
    else:
        kk, nn = (k, n) if pass_ == "fwd" else (n, k)
        tiles = math.ceil(live / bm) + e - 1
        ctas, steps = tiles * (nn // bn), kk // bk
        pad = m * kk * 2 * 2 if m % bm else 0  # jnp.pad of x to whole row blocks
        extra = (pad + (tiles * bm + m) * nn * 2 * 2) / bw + 2 * LAUNCH_S
        hbm = tiles * bm * kk * 2 + e * k * n * 2 + tiles * bm * nn * 2
        flops = 2 * live * k * n
    t, terms = grid_time(chip, loop, prof, ctas, steps)
    terms = dict(terms, registers=prof["registers"], smem_alloc=prof["smem_bytes"])
    base = f"XLA:GPU dense ragged_dot (all {m} rows x {e} groups; {BF16_GEMM_EFF:.0%} of peak)"
    label = label or f"{pass_} M={m} live={live} E={e} K={k} N={n}"
    return finish("grouped_matmul", label, chip, f"{name} ({pass_})", t, terms, hbm, flops,
                   base, dense_ragged_dot_s(chip, m, k, n, e, pass_), extra)  # fmt: skip


# (label, dispatch rows M, live rows, local experts E, K, N): Qwen3-30B-A3B's training experts
# (D 2,048, expert F 768, top-8) over one dispatch chunk of 4,096 gathered tokens: at expert = 8
# (16 local experts, ~1/8 of the 32,768 rows live: moe_parallel) and on one device (all 128).
GROUPED_SHAPES = (
    ("Qwen3-30B-A3B gate|up EP=8", 32768, 4096, 16, 2048, 768),
    ("Qwen3-30B-A3B down EP=8", 32768, 4096, 16, 768, 2048),
    ("Qwen3-30B-A3B gate|up EP=1", 32768, 32768, 128, 2048, 768),
)


CASES: list[Case] = [
    Case.make(
        "grouped_matmul", f"{label} {pass_}", GPU_CHIPS, M=m, L=live, E=e, K=k, N=n, x=pass_
    )  # fmt: skip
    for label, m, live, e, k, n in GROUPED_SHAPES
    for pass_ in ("fwd", "dgrad", "wgrad")
]


def predict(op: str, shape: dict, chip: str, label: str = "") -> Prediction:
    """The common interface (``common``) for ``grouped_matmul``."""
    if op != "grouped_matmul":
        raise ValueError(f"perf_model.gpu_grouped: no model for {op}")
    return predict_grouped_bf16(chip, shape["M"], shape["L"], shape["E"], shape["K"], shape["N"],
                                shape["x"], label=label)  # fmt: skip
