"""``grouped_fp8_matmul``: checks operands, picks an implementation from ``IMPLEMENTATIONS``.

Implementations (``backend.ImplTable``; ``impl="auto"`` takes the target's kernel when its
support check passes, else ``xla`` with one log line; an explicit impl that cannot run raises):
  * ``xla``: ``xla.grouped_fp8_matmul_xla`` (any shape; row tiles as a batch dimension);
  * ``pallas_mosaic_gpu``: the Hopper kernel;
  * ``pallas_tpu``: the Mosaic TPU kernel.
The support checks are pure Python over shapes, dtypes, tile configs and the target device;
``aot_cases.py`` compiles what they accept at Qwen3-30B-A3B shapes for H100 and TPU v5e/v6e.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.backend import Implementation, ImplTable, device_reason, target_device
from kernels_pallas.grouped_fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.grouped_fp8_matmul import pallas_tpu as tpu
from kernels_pallas.grouped_fp8_matmul import tuning
from kernels_pallas.grouped_fp8_matmul.reference import check_operands, stacks
from kernels_pallas.grouped_fp8_matmul.xla import XlaConfig, grouped_fp8_matmul_xla
from kernels_pallas.qarray import QArray
from kernels_pallas.quantize import quantize_activations

_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _common_reason(x, w_q, out_dtype) -> str | None:
    w_q = stacks(w_q)[0]  # stacks share block shape and format (operand_error)
    if tuple(w_q.block_shape) != (128, 128):
        return f"weight blocks must be (128, 128), got {w_q.block_shape}"
    if jnp.dtype(out_dtype) not in _OUT_DTYPES:
        return f"out_dtype must be bfloat16, float16 or float32, got {jnp.dtype(out_dtype)}"
    if isinstance(x, QArray) and x.values.dtype != w_q.values.dtype:
        return f"x and w FP8 formats differ ({x.values.dtype} vs {w_q.values.dtype})"
    return None


def _mgpu_supports(x, w_q, gs, *, config, out_dtype, interpret) -> str | None:
    del gs
    if config is not None and not isinstance(config, mgpu.MgpuConfig):
        return f"config is a {type(config).__name__}, not an MgpuConfig"
    if (reason := device_reason("gpu", interpret) or _common_reason(x, w_q, out_dtype)) is not None:
        return reason
    (m, k), e, ns = x.shape, stacks(w_q)[0].shape[0], tuple(w.shape[1] for w in stacks(w_q))
    out_itemsize = jnp.dtype(out_dtype).itemsize
    cfg = config or mgpu.default_config(m, ns, k, e, out_itemsize=out_itemsize)
    return mgpu.supports(m, k, ns, e, cfg, out_itemsize=out_itemsize)


def _tpu_supports(x, w_q, gs, *, config, out_dtype, interpret) -> str | None:
    del gs
    if config is not None and not isinstance(config, tpu.TpuConfig):
        return f"config is a {type(config).__name__}, not a TpuConfig"
    if (reason := device_reason("tpu", interpret) or _common_reason(x, w_q, out_dtype)) is not None:
        return reason
    (m, k), e, ns = x.shape, stacks(w_q)[0].shape[0], tuple(w.shape[1] for w in stacks(w_q))
    t = tpu.tiles(m, k, ns, e, config, interpret=interpret)
    return t if isinstance(t, str) else None


def _quantized(x, w_q) -> QArray:
    if isinstance(x, QArray):
        return x
    w0 = stacks(w_q)[0]
    return quantize_activations(x, w0.block_shape[1], w0.values.dtype)


def _run_xla(x, w_q, gs, *, config, out_dtype, interpret):
    del interpret
    cfg = config if isinstance(config, XlaConfig) else None
    return grouped_fp8_matmul_xla(_quantized(x, w_q), w_q, gs, out_dtype=out_dtype, config=cfg,
                                  platform=target_device().platform)  # fmt: skip


def _run_mgpu(x, w_q, gs, *, config, out_dtype, interpret):
    return mgpu.grouped_fp8_matmul_mgpu(_quantized(x, w_q), w_q, gs, out_dtype=out_dtype,
                                        interpret=interpret, config=config)  # fmt: skip


def _run_tpu(x, w_q, gs, *, config, out_dtype, interpret):
    return tpu.grouped_fp8_matmul_tpu(_quantized(x, w_q), w_q, gs, out_dtype=out_dtype,
                                      interpret=interpret, config=config)  # fmt: skip


IMPLEMENTATIONS = ImplTable(
    "grouped_fp8_matmul",
    [
        Implementation("xla", _run_xla),
        Implementation("pallas_mosaic_gpu", _run_mgpu, _mgpu_supports),
        Implementation("pallas_tpu", _run_tpu, _tpu_supports),
    ],
)


@functools.partial(jax.jit, static_argnames=("impl", "config", "out_dtype", "interpret"))
def _run(x, w_q, group_sizes_E, *, impl, config, out_dtype, interpret):
    return IMPLEMENTATIONS.impls[impl].run(
        x, w_q, group_sizes_E, config=config, out_dtype=out_dtype, interpret=interpret
    )


def grouped_fp8_matmul(
    x: QArray | jax.Array,
    w_q: QArray | tuple[QArray, ...],
    group_sizes_E: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    impl: str = "auto",
    config=None,
    interpret: bool = False,
) -> jax.Array:
    """Grouped blockwise FP8 W8A8 ``y_m = x_m · w[e(m)]ᵀ`` (the reference has the formula).

    ``x``: rows sorted by group, a QArray [M, K] with (128,) groups or a plain array [M, K]
    (quantized per token in groups of the weight's K block by ``quantize_activations``);
    ``w_q``: a QArray [E, N, K] (``quantize_weight`` of a stack ``[E, K, N]``), or a tuple of
    stacks [E, N_i, K] multiplied in one launch as their concatenation along N (gate and up:
    the output is [M, ΣN_i]; the weights are not concatenated in memory);
    ``group_sizes_E``: int [E], rows of each group in order (sum <= M; later rows are zero).
    ``impl``: "auto" | "xla" | "pallas_mosaic_gpu" | "pallas_tpu"; ``config``: the
    implementation's tile config (``XlaConfig``, ``MgpuConfig``, ``TpuConfig``; None: default,
    or on a Hopper GPU or a TPU with ``FP8RL_AUTOTUNE=1`` the tiles tuned there: ``tuning``).
    """
    w_q = tuple(w_q) if isinstance(w_q, list) else w_q
    check_operands(x, w_q, group_sizes_E)
    out_dtype = jnp.dtype(out_dtype)
    chosen = IMPLEMENTATIONS.select(
        impl, x, w_q, group_sizes_E, config=config, out_dtype=out_dtype, interpret=interpret
    )
    if tuning.enabled_for(impl, config, interpret, chosen.name):
        config = tuning.tuned_config(x, w_q, group_sizes_E, out_dtype=out_dtype,
                                     run=grouped_fp8_matmul)  # fmt: skip
    return _run(x, w_q, group_sizes_E, impl=chosen.name, config=config, out_dtype=out_dtype,
                interpret=interpret)  # fmt: skip
