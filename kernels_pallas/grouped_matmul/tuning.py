"""On-device autotuning of the Hopper BF16 grouped kernels' tiles (the MoE experts' training
GEMMs), one pass at a time.

``gmm_default`` / ``tgmm_default`` are rules written without a device (128x256 tiles of two
compute warpgroups where the widths allow), which the performance model ranks
(``perf_model.gpu_grouped.predict_grouped_bf16``, uncalibrated: no BF16 grouped kernel has run
on a device). With ``FP8RL_AUTOTUNE=1`` on a Hopper GPU, ``grouped_matmul(impl="auto")`` with no
config times, at each new shape, a few tiles around each pass's default the first time the pass
is traced (the forward and the input gradient through ``gmm``, the weight gradient through
``tgmm``: three records per expert GEMM) and runs the fastest, through the attention tuner's
cache (``attention_autotune.tuned``: keyed by device kind, jax version, op and shape). Each
candidate is timed on random operands of the pass's shapes with the rows spread evenly over the
groups (the routing is data: at trace time it is not known).

Candidates (``candidates``): the pass's default first, then the two-warpgroup 128x256 (3
stages) and 128x128 (4 stages of 64-K, 3 of 128-K) tiles and the one-warpgroup 64x256 and 64x128
ones, each kept where that pass's support check and SMEM budget accept it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import attention_autotune, autotune
from kernels_pallas.grouped_fp8_matmul.tuning import even_sizes
from kernels_pallas.grouped_matmul import pallas_mosaic_gpu as mgpu

OPS = {"gmm": "grouped_matmul_gmm", "tgmm": "grouped_matmul_tgmm"}  # the cache's op names
# autotuning on, "auto", no config, a real Hopper GPU
enabled_for = functools.partial(attention_autotune.enabled_for, platform="gpu")

_G = mgpu.GmmConfig
OTHERS = (_G(128, 256, 64, 3), _G(128, 128, 64, 4), _G(128, 128, 128, 3), _G(64, 256, 64, 4),
          _G(64, 128, 64, 4))  # fmt: skip


def name(cfg: mgpu.GmmConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/st{cfg.max_concurrent_steps}"


def default(kind: str, k: int, n: int, out_dtype) -> mgpu.GmmConfig:
    """The pass's untuned tile (what it runs with autotuning off)."""
    size = jnp.dtype(out_dtype).itemsize
    return mgpu.gmm_default(k, n, size) if kind == "gmm" else mgpu.tgmm_default(k, n, size)


def candidates(kind: str, k: int, n: int, dtype=jnp.bfloat16, out_dtype=jnp.bfloat16) -> list:
    """The tiles timed for one pass (``k``, ``n`` as ``pallas_mosaic_gpu.pass_reason`` takes
    them): its default first, then the ``OTHERS`` it accepts, no repeats."""
    cands = [default(kind, k, n, out_dtype), *OTHERS]
    sizes = jnp.dtype(dtype).itemsize, jnp.dtype(out_dtype).itemsize
    legal = [c for c in cands if mgpu.pass_reason(kind, k, n, c, *sizes) is None]
    return list(dict.fromkeys(legal))


def tuned_gmm(x_MK, w, group_sizes_E, *, transpose_w: bool, out_dtype, run):
    """The tuned ``GmmConfig`` of a ``gmm`` pass at this call's shapes (``run``: ``gmm_mgpu``),
    or None (nothing ran: the default)."""
    (m, k), e = x_MK.shape, w.shape[0]
    n = w.shape[1] if transpose_w else w.shape[2]
    out_dtype = jnp.dtype(out_dtype)
    cands = candidates("gmm", k, n, w.dtype, out_dtype)
    operands = _operands((m, k), w.shape, w.dtype, m, e)

    def run_with(cfg):
        fn = jax.jit(lambda a, b, g: run(a, b, g, transpose_w=transpose_w, out_dtype=out_dtype,
                                         config=cfg))  # fmt: skip
        return lambda: jax.block_until_ready(fn(*operands()))

    del group_sizes_E  # traced: tuned for the shapes, the routing spread evenly
    shape = (m, k, n, e, transpose_w, str(jnp.dtype(w.dtype)), str(out_dtype))
    return attention_autotune.tuned(OPS["gmm"], shape, cands, run_with, name_of=name)


def tuned_tgmm(x_MK, dy_MN, group_sizes_E, *, out_dtype, run):
    """The tuned ``GmmConfig`` of the weight gradient ``tgmm`` at this call's shapes (``run``:
    ``tgmm_mgpu``), or None."""
    (m, k), n, e = x_MK.shape, dy_MN.shape[1], group_sizes_E.shape[0]
    out_dtype = jnp.dtype(out_dtype)
    cands = candidates("tgmm", k, n, x_MK.dtype, out_dtype)
    operands = _operands((m, k), (m, n), x_MK.dtype, m, e)

    def run_with(cfg):
        fn = jax.jit(lambda a, b, g: run(a, b, g, out_dtype=out_dtype, config=cfg))
        return lambda: jax.block_until_ready(fn(*operands()))

    shape = (m, k, n, e, str(jnp.dtype(x_MK.dtype)), str(out_dtype))
    return attention_autotune.tuned(OPS["tgmm"], shape, cands, run_with, name_of=name)


def _operands(a_shape, b_shape, dtype, m: int, e: int):
    """Random operands of these shapes and the rows spread evenly over ``e`` groups, made on
    the first call (only if a candidate is timed) and reused after."""
    made = []

    def get():
        if not made:
            ka, kb = jax.random.split(jax.random.key(0))
            made.extend([autotune.random_like(ka, a_shape, dtype),
                         autotune.random_like(kb, b_shape, dtype),
                         even_sizes(m, e)])  # fmt: skip
        return made

    return get
