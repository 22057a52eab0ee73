"""``grouped_fp8_train_matmul``: the MoE expert stacks' W8A8 forward with a straight-through, BF16
or FP8 backward (``grouped_fp8_matmul``'s training counterpart; the dense op is ``api.py``).

Backward ``bf16``: ``jax.lax.ragged_dot`` in the compute dtype with f32 accumulation. ``fp8``: the
forward ``y_r = x̂_r · ŵ_{e(r)}`` runs ``grouped_fp8_matmul`` over rows sorted by expert
(``group_sizes_E``). Its straight-through backward in DeepSeek-V3's FP8 recipe (arXiv 2412.19437
§3.3; the dense version is ``api.fp8_grads``):

  * dgrad ``dx_r = dy_r · ŵ_{e(r)}ᵀ``: ``dy`` quantized per token in 1x128 groups along its
    contraction axis (the expert's output width), the forward's 128x128-block stacks read
    transposed (``transpose_weight``: exact), one ``grouped_fp8_matmul`` per stack (the Mosaic GPU /
    TPU grouped kernels, or XLA); a gate|up pair sums its two products;
  * wgrad ``dw_e = Σ_{r ∈ e} x_rᵀ · dy_r``: the contraction is over the expert's tokens, so ``x``
    and ``dy`` are re-quantized in groups of 128 tokens *within each expert's rows*
    (``quantize_token_groups``: the 128x1 tiles of DeepGEMM's k-grouped wgrad, where every expert's
    token range starts a new tile), then contracted per expert with f32 accumulation
    (``jax.lax.ragged_dot``'s transpose over the dequantized FP8 operands: exact products of FP8
    values and FP32 scales, like ``fp8_matmul``'s XLA path for the dense wgrad; no Pallas kernel
    contracts a ragged token axis).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp

from kernels_pallas.fp8_train_matmul.api import (
    GROUP,
    TrainMatmulConfig,
    quantize_train_weight,
    transpose_weight,
)
from kernels_pallas.grouped_fp8_matmul import grouped_fp8_matmul
from kernels_pallas.grouped_fp8_matmul.tiles import group_of
from kernels_pallas.grouped_matmul import grouped_matmul
from kernels_pallas.qarray import SCALE_TINY, QArray, fp8_max
from kernels_pallas.quantize import amax_to_scale, quantize_activations, saturating_cast


def token_tiles(group_sizes_E: jax.Array, num_rows: int, group: int = GROUP):
    """``(tile_R, num_tiles)``: each row's 128-token tile within its expert's rows.

    Expert e's rows ``[start_e, start_e + |e|)`` form ``ceil(|e| / group)`` tiles, numbered after
    the tiles of the experts before it; rows past ``Σ_e |e|`` go to one extra tile, the last.
    ``num_tiles`` is a static bound: ``Σ_e ceil(|e|/g) <= (R + (g-1)·E) // g``, plus that tile.
    """
    gs = group_sizes_E.astype(jnp.int32)
    num_experts = gs.shape[0]
    ends = jnp.cumsum(gs)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    e_R = group_of(ends, rows)  # E past the last group
    e_safe = jnp.minimum(e_R, num_experts - 1)
    tiles_E = (gs + group - 1) // group
    first_tile_E = jnp.cumsum(tiles_E) - tiles_E
    num_tiles = (num_rows + (group - 1) * num_experts) // group + 1
    in_expert = rows - (ends - gs)[e_safe]
    tile_R = jnp.where(e_R < num_experts, first_tile_E[e_safe] + in_expert // group, num_tiles - 1)
    return tile_R, num_tiles


def quantize_token_groups(
    x_RC: jax.Array, group_sizes_E: jax.Array, dtype="float8_e4m3fn", group: int = GROUP
) -> jax.Array:
    """``x`` rounded through FP8 in 128-token tiles per expert and column: ``x̂ · s`` in f32.

    ``s_{t,c} = max(amax_{r ∈ t} |x_{r,c}|, tiny) / fp8_max`` for tile t (``token_tiles``), and
    ``x̂ = cast(clamp(x · fp8_max / max(amax, tiny)))``: ``quantize_activations``' rule with the
    group running down the token axis and restarting at every expert boundary.
    """
    tile_R, num_tiles = token_tiles(group_sizes_E, x_RC.shape[0], group)
    x = x_RC.astype(jnp.float32)
    amax_TC = jax.ops.segment_max(jnp.abs(x), tile_R, num_segments=num_tiles)  # empty: -inf
    inv_TC = fp8_max(dtype) / jnp.maximum(amax_TC, SCALE_TINY)
    q = saturating_cast(x * inv_TC[tile_R], dtype)
    return q.astype(jnp.float32) * amax_to_scale(amax_TC, dtype)[tile_R]


def _wgrad(x_hat_RD, dy_hat_RF, group_sizes_E, num_experts: int) -> jax.Array:
    """``dw_e = Σ_{r ∈ e} x̂_rᵀ · d̂y_r`` [E, D, F] in f32 (the transpose of ``ragged_dot``)."""
    w0 = jnp.zeros((num_experts, x_hat_RD.shape[1], dy_hat_RF.shape[1]), jnp.float32)

    def fwd(w):
        return jax.lax.ragged_dot(x_hat_RD, w, group_sizes_E.astype(jnp.int32),
                                  precision=jax.lax.Precision.HIGHEST,
                                  preferred_element_type=jnp.float32)  # fmt: skip

    return jax.vjp(fwd, w0)[1](dy_hat_RF)[0]


def grouped_fp8_grads(
    x_RD: jax.Array,
    ws_q: tuple[QArray, ...],
    dys_RF: tuple[jax.Array, ...],
    group_sizes_E: jax.Array,
    cfg: TrainMatmulConfig,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """``(dx [R, D] f32, (dw_i [E, D, F_i] f32, ...))`` by the FP8 GEMMs of the module docstring.

    ``ws_q``: the forward's stacks ``[E, F_i, D]`` (``quantize_train_weight`` of ``[E, D, F_i]``);
    ``dys_RF``: the cotangent of each stack's output columns.
    """
    dx = jnp.zeros(x_RD.shape, jnp.float32)
    for w_q, dy in zip(ws_q, dys_RF, strict=True):
        dy_q = quantize_activations(dy, GROUP, cfg.dtype)  # 1x128 along F
        dx = dx + grouped_fp8_matmul(dy_q, transpose_weight(w_q), group_sizes_E,
                                     out_dtype=jnp.float32, impl=cfg.impl,
                                     interpret=cfg.interpret)  # fmt: skip
    x_hat = quantize_token_groups(x_RD, group_sizes_E, cfg.dtype)
    num_experts = ws_q[0].shape[0]
    dws = tuple(
        _wgrad(
            x_hat, quantize_token_groups(dy, group_sizes_E, cfg.dtype), group_sizes_E, num_experts
        )  # fmt: skip
        for dy in dys_RF
    )
    return dx, dws


# --- the op: forward as the rollout runs it, straight-through backward ---


def _forward(x_RD, ws_EDF, group_sizes_E, cfg: TrainMatmulConfig):
    ws_q = tuple(quantize_train_weight(w, cfg) for w in ws_EDF)
    x_q = quantize_activations(x_RD, ws_q[0].block_shape[1], ws_q[0].values.dtype)
    w_arg = ws_q if len(ws_q) > 1 else ws_q[0]
    y = grouped_fp8_matmul(x_q, w_arg, group_sizes_E, out_dtype=x_RD.dtype, impl=cfg.impl,
                           interpret=cfg.interpret)  # fmt: skip
    return y, ws_q


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_fp8_train_matmul(x_RD, ws_EDF: tuple, group_sizes_E, cfg: TrainMatmulConfig):
    """Sorted rows ``x [R, D]`` times their expert's stacks ``ws [E, D, F_i]`` (a tuple: one launch
    over their concatenation along F, e.g. gate and up): ``grouped_fp8_matmul`` exactly as the
    rollout calls it (1x128 activation groups), straight-through gradients (module docstring)."""
    return _forward(x_RD, ws_EDF, group_sizes_E, cfg)[0]


def _fwd(x, ws, gs, cfg):
    y, ws_q = _forward(x, ws, gs, cfg)
    return y, (x, ws, gs, ws_q if cfg.backward == "fp8" else None)


def _bwd(cfg, res, dy):
    x, ws, gs, ws_q = res
    bounds = list(itertools.accumulate(w.shape[-1] for w in ws))[:-1]  # static: no tracer
    dys = jnp.split(dy, bounds, axis=-1)
    if cfg.backward == "fp8":
        dx, dws = grouped_fp8_grads(x, ws_q, tuple(dys), gs, cfg)
        dws = tuple(d.astype(w.dtype) for d, w in zip(dws, ws, strict=True))
        return dx.astype(x.dtype), dws, None
    dx = jnp.zeros(x.shape, jnp.float32)
    dws = []
    for w, d in zip(ws, dys, strict=True):
        # BF16 GEMMs, f32 accumulation: grouped_matmul's gradients (the Hopper kernels on H100,
        # where XLA would expand ragged_dot densely; ragged_dot elsewhere).
        _, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs).astype(jnp.float32), x, w)
        ddx, ddw = vjp(d.astype(jnp.float32))
        dx, dws = dx + ddx.astype(jnp.float32), [*dws, ddw]
    return dx.astype(x.dtype), tuple(dws), None


grouped_fp8_train_matmul.defvjp(_fwd, _bwd)
