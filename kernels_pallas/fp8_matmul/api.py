"""``fp8_matmul``: checks operands once, picks an implementation from ``IMPLEMENTATIONS``, runs it.

Implementations (``backend.ImplTable``; ``impl="auto"`` takes the target's kernel when its
support check passes, else ``xla`` with one log line; an explicit impl that cannot run raises):
  * ``xla``: ``xla.fp8_matmul_xla`` (any shape; the exact reference on CPU, fast paths on GPU);
  * ``pallas_mosaic_gpu``: the Hopper kernel (FP8 x; BF16/F16 x at M = 16, and at 17-64 rows
    where the performance model says, quantized in-kernel by the fused decode tiles,
    ``fused_default``; elsewhere, and F32 x, quantized once first by the one-launch
    ``act_quantize`` kernel; in-kernel wherever an explicit config is one the fused kernel
    runs); without a config, the tile ``tile_choice.dispatch_config`` picks (the performance
    model's fastest where it clearly beats the rules of ``mgpu_config.default_config``);
  * ``impl="auto"`` with ``FP8RL_AUTOTUNE=1`` on a GPU/TPU: the fastest candidate timed on the
    device (``tuning``: the candidates and how they are timed; ``kernels_pallas.autotune``: the
    timer and the cache), cached per device kind, jax version and shape;
  * ``pallas_tpu``: the Mosaic TPU kernel.
The support checks are pure Python over shapes, dtypes, tile configs and the target device, and
are exact: ``aot_cases.py`` compiles what they accept at real shapes for H100 and TPU v5e/v6e.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kernels_pallas import act_quantize, autotune
from kernels_pallas.backend import Implementation, ImplTable, device_reason, target_device
from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.fp8_matmul import pallas_tpu as tpu
from kernels_pallas.fp8_matmul import tile_choice
from kernels_pallas.fp8_matmul.mgpu_config import (
    FUSED_DECODE_ROWS,
    fused_enabled,
    fused_refuses,
)
from kernels_pallas.fp8_matmul.reference import check_operands
from kernels_pallas.fp8_matmul.xla import XlaConfig, fp8_matmul_xla
from kernels_pallas.qarray import QArray
from kernels_pallas.quantize import quantize_activations

_RAW_16BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _rows(x) -> int:
    return math.prod(x.shape[:-1])


def fused_default(m: int, n: int, k: int, chip: str | None = None) -> bool:
    """Whether raw BF16/F16 x [M, K] takes the fused (in-kernel quantization) kernel by default:
    decode batches of ``FUSED_DECODE_ROWS`` (16) rows, the fused kernel's 16-row swap-AB tile,
    and at 17-64 rows where the performance model says so for ``chip`` (None: the target
    device's; ``tile_choice.fused_wins``).

    There the CTA's compute warpgroups quantize the tile's x rows per 128-K slice between
    them (``mgpu_fused_swap``), under the weight bytes that bound a decode GEMM, and the call is
    one kernel: no ``act_quantize`` launch before it, no padding of M to the 32-row tile of FP8
    x (whose ring carries 128-B stages of x scales) and no slice of the output after it. The
    performance model (the compiled K loops: 263-267 SASS instructions per warp per two-slice
    step at 16 rows, 350 at 32 rows, 318 per slice at 64 rows, against 145-147 unfused) puts
    it 1.02-1.26x faster than quantize-once at M = 16 on every decode shape of
    ``perf_model.gpu_targets`` on the H100 and the H200. Below 16 rows x would be padded to the
    tile first (``jnp.pad``: an XLA launch, as costly as the ``act_quantize`` launch it saves:
    0.95-1.01x; likewise at 17-31 and 33-63 rows). At 32 and 64 rows it depends on the chip
    and the shape: the fused kernel's x quantization (issue-bound) outweighs the saved launch on
    wide, short-K shapes (Qwen3-8B gate+up on the H100) and not on narrow or launch-bound ones
    (k|v_proj, Qwen3-30B-A3B o_proj), and the H200's faster HBM leaves less issue time per
    weight byte. So there the model decides per shape, with the margin and guard of the tile
    choice (``tile_choice.fused_wins``: >5% faster calibrated and by the SASS model alone, in a
    program and standalone); elsewhere x is quantized once per 1x128 group (one
    ``act_quantize`` launch) and the QArray kernel runs. An explicit swap-AB config
    with raw x runs fused (``_fused``), so the autotuner times fused tiles there. A prefill CTA
    re-quantizing its x slice N/128 times over is issue-bound (476 instructions per K step
    against 128; 0.36-0.95x the quantize-once time at M 128-4096 on the rollout shapes,
    1.02-1.05x on one narrow one): the fused prefill tiles run only with an explicit config.
    Never with ``FP8RL_FUSED_X=0`` (``mgpu_config.fused_enabled``)."""
    if not fused_enabled():
        return False
    if m == FUSED_DECODE_ROWS:
        return True
    if chip is None:
        chip = tile_choice.chip_of(target_device().device_kind)
    return tile_choice.fused_wins(m, n, k, chip=chip)


def _fused(x, config, n: int, k: int) -> bool:
    """Raw BF16/F16 x goes to the fused kernel where ``fused_default`` says, or where an
    explicit config is one it runs (``mgpu_config.fused_refuses``); otherwise ``act_quantize``
    quantizes it once."""
    if isinstance(x, QArray) or x.dtype not in _RAW_16BIT:
        return False
    if config is not None:
        return fused_refuses(config) is None
    return fused_default(_rows(x), n, k)


def _mgpu_config(x, w_q, config, out_dtype) -> mgpu.MgpuConfig:
    m, n, k = _rows(x), w_q.shape[0], w_q.shape[1]
    out_itemsize = jnp.dtype(out_dtype).itemsize
    return config or tile_choice.dispatch_config(
        m,
        n,
        k,
        fused=_fused(x, config, n, k),
        out_itemsize=out_itemsize,
        chip=tile_choice.chip_of(target_device().device_kind),
    )


def _mgpu_supports(x, w_q, *, config, out_dtype, interpret) -> str | None:
    if config is not None and not isinstance(config, mgpu.MgpuConfig):
        return f"config is a {type(config).__name__}, not an MgpuConfig"
    if (reason := device_reason("gpu", interpret)) is not None:
        return reason
    if tuple(w_q.block_shape) != (128, 128):
        return f"weight blocks must be (128, 128), got {w_q.block_shape}"
    if jnp.dtype(out_dtype) not in (*_RAW_16BIT, jnp.dtype(jnp.float32)):
        return f"out_dtype must be bfloat16, float16 or float32, got {jnp.dtype(out_dtype)}"
    if isinstance(x, QArray) and x.values.dtype != w_q.values.dtype:
        return f"x and w FP8 formats differ ({x.values.dtype} vs {w_q.values.dtype})"
    if not isinstance(x, QArray) and x.dtype not in _RAW_16BIT and x.dtype != jnp.float32:
        return f"raw x must be bfloat16, float16 or float32, got {x.dtype}"
    fused = _fused(x, config, w_q.shape[0], w_q.shape[1])
    cfg = _mgpu_config(x, w_q, config, out_dtype)
    m, n, k = _rows(x), w_q.shape[0], w_q.shape[1]
    return mgpu.supports(m, k, n, cfg, fused=fused, x_itemsize=2 if fused else 1,
                         out_itemsize=jnp.dtype(out_dtype).itemsize)  # fmt: skip


def _tpu_supports(x, w_q, *, config, out_dtype, interpret) -> str | None:
    if config is not None and not isinstance(config, tpu.TpuConfig):
        return f"config is a {type(config).__name__}, not a TpuConfig"
    if (reason := device_reason("tpu", interpret)) is not None:
        return reason
    if tuple(w_q.block_shape) != (128, 128):
        return f"weight blocks must be (128, 128), got {w_q.block_shape}"
    if isinstance(x, QArray) and x.values.dtype != w_q.values.dtype:
        return f"x and w FP8 formats differ ({x.values.dtype} vs {w_q.values.dtype})"
    t = tpu.tiles(_rows(x), w_q.shape[1], w_q.shape[0], config, interpret=interpret)
    return t if isinstance(t, str) else None


def _quantized(x, w_q: QArray) -> QArray:
    if isinstance(x, QArray):
        return x
    return quantize_activations(x, w_q.block_shape[1], w_q.values.dtype)


def _run_xla(x, w_q, *, config, out_dtype, interpret):
    del interpret
    cfg = config if isinstance(config, XlaConfig) else None
    platform = target_device().platform
    return fp8_matmul_xla(_quantized(x, w_q), w_q, out_dtype=out_dtype, config=cfg,
                          platform=platform)  # fmt: skip


def quantize_once(x: jax.Array, w_q: QArray, *, interpret: bool = False) -> QArray:
    """Raw x [M, K] as the Hopper kernel's quantize-once path makes it for its default tile
    (``act_quantize``'s one launch, rows padded to the tile): what ``fp8_matmul`` runs wherever
    ``fused_default`` says no, here at any M (``bench_matmul``'s ``+quant:once`` arm, beside
    the fused kernel). ``fp8_matmul`` of it returns the padded rows."""
    m, (n, k) = _rows(x), w_q.shape
    chip = tile_choice.chip_of(target_device().device_kind)
    cfg = tile_choice.dispatch_config(m, n, k, chip=chip)
    return _mgpu_quantized(x, w_q, cfg, interpret)


def _mgpu_quantized(x, w_q: QArray, cfg, interpret: bool) -> QArray:
    """x as the Hopper kernel reads it: a QArray as given; raw x quantized by the one-launch
    ``act_quantize`` kernel (padded to the CTA row tile), which reads x once where XLA's
    ``quantize_activations`` reads it twice in two to three launches; by XLA where the kernel
    cannot run (no Triton backend, an 8-row tile)."""
    if isinstance(x, QArray):
        return x
    tile = cfg.block_m * cfg.cluster_m
    rows = -(-_rows(x) // tile) * tile
    if act_quantize.supports(x.shape, rows) is not None:  # e.g. an 8-row tile
        return _quantized(x, w_q)
    return act_quantize.quantize_activations_triton(
        x, 128, w_q.values.dtype, rows=rows, interpret=interpret
    )


def _run_mgpu(x, w_q, *, config, out_dtype, interpret):
    cfg = _mgpu_config(x, w_q, config, out_dtype)
    if _fused(x, config, *w_q.shape):
        return mgpu.fp8_matmul_mgpu_fused(x, w_q, out_dtype=out_dtype, interpret=interpret,
                                          config=cfg)  # fmt: skip
    y = mgpu.fp8_matmul_mgpu(_mgpu_quantized(x, w_q, cfg, interpret), w_q, out_dtype=out_dtype,
                             interpret=interpret, config=cfg)  # fmt: skip
    return y[: _rows(x)]


def _run_tpu(x, w_q, *, config, out_dtype, interpret):
    return tpu.fp8_matmul_tpu(_quantized(x, w_q), w_q, out_dtype=out_dtype, interpret=interpret,
                              config=config)  # fmt: skip


IMPLEMENTATIONS = ImplTable(
    "fp8_matmul",
    [
        Implementation("xla", _run_xla),
        Implementation("pallas_mosaic_gpu", _run_mgpu, _mgpu_supports),
        Implementation("pallas_tpu", _run_tpu, _tpu_supports),
    ],
)


def _flat(x):
    """[..., K] -> [M, K] (QArray or array)."""
    if isinstance(x, QArray):
        k, g = x.shape[-1], x.scales.shape[-1]
        return QArray(x.values.reshape(-1, k), x.scales.reshape(-1, g), x.block_shape, x.dtype)
    return x.reshape(-1, x.shape[-1])


@functools.partial(jax.jit, static_argnames=("impl", "config", "out_dtype", "interpret"))
def _run(x, w_q, *, impl, config, out_dtype, interpret):
    return IMPLEMENTATIONS.impls[impl].run(
        x, w_q, config=config, out_dtype=out_dtype, interpret=interpret
    )


def fp8_matmul(
    x: QArray | jax.Array,
    w_q: QArray,
    *,
    out_dtype=jnp.bfloat16,
    impl: str = "auto",
    config=None,
    interpret: bool = False,
) -> jax.Array:
    """Blockwise FP8 W8A8 ``y = x · wᵀ`` (``fp8_matmul_reference`` has the formula).

    ``x``: a QArray [..., K] with (128,) groups or a plain array [..., K], quantized per token in
    groups of the weight's K block once, by ``quantize_activations`` or its one-launch kernel
    (``act_quantize`` on Hopper: same bits), or on Hopper in-kernel (the fused decode tiles at
    16-64 rows, ``fused_default``; an explicit ``MgpuConfig`` the fused kernel runs); leading axes
    are flattened into M.
    ``w_q``: a QArray [N, K] (``quantize_weight``). ``impl``: "auto" | "xla" |
    "pallas_mosaic_gpu" | "pallas_tpu"; ``config``: the implementation's tile config
    (``XlaConfig``, ``MgpuConfig``, ``TpuConfig``; None: per-shape default).
    """
    check_operands(x, w_q)
    out_dtype = jnp.dtype(out_dtype)
    x2 = _flat(x)
    if impl == "auto" and config is None and not interpret and autotune.enabled():
        from kernels_pallas.fp8_matmul import tuning

        impl, config = tuning.autotuned(x2, w_q, out_dtype)
        if isinstance(config, tuning.QuantizedOnce):  # x quantized once, not fused: faster
            y = tuning.quantized_once(x2, w_q, config, out_dtype, interpret)
            return y.reshape(*x.shape[:-1], w_q.shape[0])
    chosen = IMPLEMENTATIONS.select(
        impl, x2, w_q, config=config, out_dtype=out_dtype, interpret=interpret
    )
    y = _run(x2, w_q, impl=chosen.name, config=config, out_dtype=out_dtype, interpret=interpret)
    return y.reshape(*x.shape[:-1], w_q.shape[0])
