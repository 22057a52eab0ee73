"""``fp8_matmul``: checks operands once, picks an implementation from ``IMPLEMENTATIONS``, runs it.

Implementations (``backend.ImplTable``; ``impl="auto"`` takes the target's kernel when its
support check passes, else ``xla`` with one log line; an explicit impl that cannot run raises):
  * ``xla``: ``xla.fp8_matmul_xla`` (any shape; the exact reference on CPU, fast paths on GPU);
  * ``pallas_mosaic_gpu``: the Hopper kernel (FP8 x, or BF16/F16 x quantized in-kernel);
  * ``pallas_tpu``: the Mosaic TPU kernel.
The support checks are pure Python over shapes, dtypes, tile configs and the target device, and
are exact: ``aot_cases.py`` compiles what they accept at real shapes for H100 and TPU v5e/v6e.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kernels_pallas.backend import Implementation, ImplTable, device_reason, target_device
from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.fp8_matmul import pallas_tpu as tpu
from kernels_pallas.fp8_matmul.reference import check_operands
from kernels_pallas.fp8_matmul.xla import XlaConfig, fp8_matmul_xla
from kernels_pallas.qarray import QArray
from kernels_pallas.quantize import quantize_activations

_RAW_16BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _rows(x) -> int:
    return math.prod(x.shape[:-1])


def _fused(x, config) -> bool:
    """Raw BF16/F16 x goes to the fused kernel, except in decode (M <= 64) by default: there the
    activations are quantized by XLA (fused into their producer) and the swap-AB kernel runs."""
    if isinstance(x, QArray) or x.dtype not in _RAW_16BIT:
        return False
    if config is not None:
        return not config.swap_ab
    return _rows(x) > 64


def _mgpu_config(x, w_q, config, out_dtype) -> mgpu.MgpuConfig:
    m, n, k = _rows(x), w_q.shape[0], w_q.shape[1]
    out_itemsize = jnp.dtype(out_dtype).itemsize
    return config or mgpu.default_config(
        m, n, k, fused=_fused(x, config), out_itemsize=out_itemsize
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
    fused = _fused(x, config)
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


def _run_mgpu(x, w_q, *, config, out_dtype, interpret):
    cfg = _mgpu_config(x, w_q, config, out_dtype)
    if _fused(x, config):
        return mgpu.fp8_matmul_mgpu_fused(x, w_q, out_dtype=out_dtype, interpret=interpret,
                                          config=cfg)  # fmt: skip
    return mgpu.fp8_matmul_mgpu(_quantized(x, w_q), w_q, out_dtype=out_dtype,
                                interpret=interpret, config=cfg)  # fmt: skip


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
    groups of the weight's K block (in-kernel by the Hopper kernel for BF16/F16 ``x`` beyond
    decode sizes, by ``quantize_activations`` otherwise); leading axes are flattened into M.
    ``w_q``: a QArray [N, K] (``quantize_weight``). ``impl``: "auto" | "xla" |
    "pallas_mosaic_gpu" | "pallas_tpu"; ``config``: the implementation's tile config
    (``XlaConfig``, ``MgpuConfig``, ``TpuConfig``; None: per-shape default).
    """
    check_operands(x, w_q)
    out_dtype = jnp.dtype(out_dtype)
    x2 = _flat(x)
    chosen = IMPLEMENTATIONS.select(
        impl, x2, w_q, config=config, out_dtype=out_dtype, interpret=interpret
    )
    y = _run(x2, w_q, impl=chosen.name, config=config, out_dtype=out_dtype, interpret=interpret)
    return y.reshape(*x.shape[:-1], w_q.shape[0])
