"""Activation quantization fused into its producer: one Pallas (Triton) launch each.

In the compiled H100 decode loop every FP8 GEMM's input took two launches: its producer (an XLA
fusion: RMSNorm, the SiLU product, the attention chunks' combine) and ``act_quantize``. The BF16
program runs the producers too, so the quantization launch was FP8's alone (4 per layer,
``experiments/results/rollout_launches.json``). Each kernel here computes the producer and
quantizes its output (per token, 1x128 groups) in one launch, writing the layout the Hopper GEMM
reads (scales ``[K/128, rows]``, returned as the transposed view of a QArray, which the GEMM
transposes back: XLA cancels the pair):

* ``rmsnorm_quantize``: ``rms_norm(x, w, eps)`` then quantization; one program per row, the whole
  row in registers (D / 128 a power of two: Triton blocks are);
* ``swiglu_quantize``: ``silu(gate) ⊙ up`` from the fused gate|up GEMM's output (128-column
  blocks interleaved: ``models.fused.split_gate_up``) or from two arrays;
* ``combine_quantize``: decode attention's chunk combine (``decode_attention.common
  .combine_splits``, its log-sum-exps read from the Mosaic kernel's raw ``[B, J, K, 64]`` tiles),
  the static V scale and the cast to the query dtype, for a head dim of 128 (one group per head).

The math is the reference's (``reference.py``) in the same order and dtypes, each op rounded
to the activations' dtype where XLA rounds it: in interpret mode the kernels equal the
references bit for bit (16-bit inputs; f32 RMSNorm input moves the scale's last bit with the
row sum's order). On a GPU, Triton's ``rsqrt``, ``exp`` and ``exp2`` may differ from XLA's in
the last f32 bit, so the device tests bound the difference by one BF16 rounding instead.
Every function here takes rows in multiples of 16, decode batches and prefill alike (callers fall
back to the reference, XLA, otherwise: ``api.py``). At prefill sizes launches no longer decide,
bytes do, and each kernel reads its inputs once where XLA's fusions of the references read them
twice (RMSNorm: a norm fusion and a quantize fusion over x; SwiGLU: an amax fusion and a cast
fusion over gate and up; the deviceless H100 compile at M = 4096).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.act_quantize.pallas_triton import (
    GROUP,
    ROWS,
    div_xla,
    pltriton,
    quantize_rows,
    row_block,
)
from kernels_pallas.qarray import QArray, fp8_dtype

F32 = jnp.float32


def _rounded(x: jax.Array, dtype) -> jax.Array:
    """f32 ``x`` rounded to ``dtype`` (the producer's output type) and back."""
    return x.astype(dtype).astype(F32)


def _params(num_warps: int, interpret: bool):
    return None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1)


def _qarray(values, scales_GR, dtype) -> QArray:
    return QArray(values, scales_GR.T, (GROUP,), jnp.dtype(dtype))


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _rows_reason(m: int) -> str | None:
    if pltriton is None:
        return "this jax has no Pallas Triton backend"
    if m < 1 or m % ROWS:
        return f"rows M={m} must be a positive multiple of {ROWS}"
    return None


# --- RMSNorm + quantize -----------------------------------------------------------------------


def rmsnorm_supports(x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> str | None:
    """None if ``rmsnorm_quantize_triton`` takes x ``[M, D]`` and w ``[D]``, else why not."""
    if len(x_shape) != 2 or tuple(w_shape) != x_shape[-1:]:
        return f"need x [M, D] and w [D], got {x_shape} and {w_shape}"
    m, d = x_shape
    if d % GROUP or not _is_pow2(d // GROUP):
        return f"D={d} must be 128 x a power of two (the row is one Triton block)"
    return _rows_reason(m)


def _rmsnorm_kernel(x_ref, w_ref, q_ref, s_ref, *, eps: float, dtype, interpret: bool):
    x = x_ref[0].astype(F32)  # [G, GROUP]: the whole row
    d = x.shape[0] * x.shape[1]
    ms = jnp.sum(jnp.sum(x * x, axis=1), axis=0) / d  # jnp.mean: the sum over D, divided by D
    normed = _rounded(x * lax.rsqrt(ms + eps), x_ref.dtype)
    h = _rounded(w_ref[...].astype(F32) * normed, x_ref.dtype)
    q_ref[0], s = quantize_rows(h, dtype, interpret)
    s_ref[...] = s[:, None]


@functools.partial(jax.jit, static_argnames=("eps", "dtype", "interpret"))
def rmsnorm_quantize_triton(x_MD, w_D, eps: float, dtype=jnp.float8_e4m3fn, *,
                            interpret: bool = False) -> QArray:  # fmt: skip
    """``rmsnorm_quantize_reference`` for x ``[M, D]`` as one GPU kernel (module docstring)."""
    if (reason := rmsnorm_supports(x_MD.shape, w_D.shape)) is not None:
        raise ValueError(f"rmsnorm_quantize_triton: {reason}")
    dtype = fp8_dtype(dtype)
    m, d = x_MD.shape
    g = d // GROUP
    values, scales_GM = pl.pallas_call(
        functools.partial(_rmsnorm_kernel, eps=float(eps), dtype=dtype, interpret=interpret),
        grid=(m,),
        in_specs=[
            pl.BlockSpec((1, g, GROUP), lambda i: (i, 0, 0)),
            pl.BlockSpec((g, GROUP), lambda i: (0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((1, g, GROUP), lambda i: (i, 0, 0)),
            pl.BlockSpec((g, 1), lambda i: (0, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((m, g, GROUP), dtype),
            jax.ShapeDtypeStruct((g, m), F32),
        ],
        interpret=interpret,
        compiler_params=_params(8 if d > 4096 else 4, interpret),
        name="rmsnorm_quantize_triton",
    )(x_MD.reshape(m, g, GROUP), w_D.reshape(g, GROUP))
    return _qarray(values.reshape(m, d), scales_GM, x_MD.dtype)


# --- SwiGLU + quantize ------------------------------------------------------------------------


def swiglu_supports(gate_shape: tuple[int, ...], fused: bool) -> str | None:
    """None if ``swiglu_quantize_triton`` takes this gate|up ``[M, 2F]`` (``fused``) or gate
    ``[M, F]``, else why not."""
    if len(gate_shape) != 2:
        return f"need [M, {'2F' if fused else 'F'}], got {gate_shape}"
    m, n = gate_shape
    if n % (2 * GROUP if fused else GROUP) or n == 0:
        return f"the {'gate|up' if fused else 'gate'} width {n} is not a multiple of {GROUP} blocks"
    return _rows_reason(m)


def _swiglu_kernel(g_ref, u_ref, q_ref, s_ref, *, out_dtype, dtype, interpret: bool):
    g = g_ref[:, 0, 0, :].astype(F32)  # [row_block, GROUP]
    u = u_ref[:, 0, 0, :].astype(F32)
    # jax.nn.silu in the inputs' dtype: g / (1 + exp(-g)) rounded after every op, as XLA does
    den = _rounded(1.0 + _rounded(jnp.exp(-g), out_dtype), out_dtype)
    sig = _rounded(div_xla(jnp.ones_like(g), den, interpret), out_dtype)
    h = _rounded(_rounded(g * sig, out_dtype) * u, out_dtype)
    q_ref[...], s = quantize_rows(h, dtype, interpret)
    s_ref[...] = s[None, :]


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def swiglu_quantize_triton(gate, up=None, dtype=jnp.float8_e4m3fn, *,
                           interpret: bool = False) -> QArray:  # fmt: skip
    """``swiglu_quantize_reference`` as one GPU kernel. ``up=None``: ``gate`` is the fused
    gate|up GEMM output ``[M, 2F]`` (gate and up in alternating 128-column blocks); else gate
    and up are ``[M, F]`` each. Returns a QArray ``[M, F]``."""
    fused = up is None
    if (reason := swiglu_supports(gate.shape, fused)) is not None:
        raise ValueError(f"swiglu_quantize_triton: {reason}")
    if not fused and up.shape != gate.shape:
        raise ValueError(f"swiglu_quantize_triton: up {up.shape} != gate {gate.shape}")
    dtype = fp8_dtype(dtype)
    m, n = gate.shape
    f = n // 2 if fused else n
    blocks = f // GROUP
    if fused:  # [M, F/128, 2, 128]: gate at [..., 0, :], up at [..., 1, :]
        operands = [gate.reshape(m, blocks, 2, GROUP)] * 2
        g_spec, u_spec = ((lambda i, j, h=h: (i, j, h, 0)) for h in (0, 1))
    else:
        operands = [a.reshape(m, blocks, 1, GROUP) for a in (gate, up)]
        g_spec = u_spec = lambda i, j: (i, j, 0, 0)
    r = row_block(m)
    block = (r, 1, 1, GROUP)
    values, scales_GM = pl.pallas_call(
        functools.partial(_swiglu_kernel, out_dtype=gate.dtype, dtype=dtype, interpret=interpret),
        grid=(m // r, blocks),
        in_specs=[pl.BlockSpec(block, g_spec), pl.BlockSpec(block, u_spec)],
        out_specs=[
            pl.BlockSpec((r, GROUP), lambda i, j: (i, j)),
            pl.BlockSpec((1, r), lambda i, j: (j, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((m, f), dtype), jax.ShapeDtypeStruct((blocks, m), F32)],
        interpret=interpret,
        compiler_params=_params(4, interpret),
        name="swiglu_quantize_triton",
    )(*operands)
    return _qarray(values, scales_GM, gate.dtype)


# --- decode attention's combine + quantize ----------------------------------------------------

MAX_SPLITS = 16
LSE_TILE = 64  # the Mosaic decode kernel's lse rows per KV head (its 64-row query window)


def combine_supports(o_shape: tuple[int, ...], out_dtype) -> str | None:
    """None if ``combine_quantize_triton`` takes chunk outputs ``[B, J, H, C]`` (or the swap-AB
    kernel's transposed ``[B, J, K, C, N]``), else why not."""
    if len(o_shape) not in (4, 5):
        return f"need chunk outputs [B, J, H, C] or [B, J, K, C, N], got {o_shape}"
    b, j, c = o_shape[0], o_shape[1], o_shape[3]
    if c != GROUP:
        return f"head_dim {c} != {GROUP} (one quantization group per head)"
    if not _is_pow2(j) or j > MAX_SPLITS:
        return f"num_splits {j} not a power of two <= {MAX_SPLITS}"
    if jnp.dtype(out_dtype) not in map(jnp.dtype, (jnp.bfloat16, jnp.float16, F32)):
        return f"output dtype {jnp.dtype(out_dtype)} not bfloat16, float16 or float32"
    return _rows_reason(b)


def lse_row(h, group: int):
    """Query head ``h``'s row in its KV head's 64-row lse tile (``pallas_mosaic_gpu._lse_rows``):
    the window starts at the 8-aligned row below ``kh · group``."""
    return (h // group * group) % 8 + h % group


def _combine_kernel(o_ref, *refs, group: int, splits: int, swapped: bool, out_dtype, dtype,
                    interpret: bool):  # fmt: skip
    # swapped: o block [ROWS, J, 1, C, 1] (head hh's column of the transposed chunk outputs),
    # lse block [ROWS, J, 1, N] with head hh at column hh % group
    chunk = (lambda j: o_ref[:, j, 0, :, 0]) if swapped else (lambda j: o_ref[:, j, 0, :])
    if splits > 1:  # chunk outputs and their log-sum-exps, one chunk at a time (registers)
        lse_ref, vs_ref, q_ref, s_ref = refs
        hh, width = pl.program_id(1), lse_ref.shape[-1]
        row = hh % group if swapped else lse_row(hh, group)
        col = lax.broadcasted_iota(jnp.int32, (ROWS, width), 1)
        lse = [jnp.max(jnp.where(col == row, lse_ref[:, j, 0, :], -jnp.inf), axis=1)
               for j in range(splits)]  # fmt: skip
        m = functools.reduce(jnp.maximum, lse)
        m = jnp.where(m > -jnp.inf, m, 0.0)  # every chunk empty: zeros, as combine_splits
        w = [jnp.exp2(x - m) for x in lse]  # [ROWS] each
        den = functools.reduce(jnp.add, w)
        num = functools.reduce(jnp.add, (w[j][:, None] * chunk(j) for j in range(splits)))
        o = div_xla(num, jnp.where(den > 0, den, 1.0)[:, None] + jnp.zeros_like(num), interpret)
    else:
        vs_ref, q_ref, s_ref = refs
        o = chunk(0)
    h = _rounded(o * vs_ref[...], out_dtype)  # the static V scale, then the query dtype
    q_ref[...], s = quantize_rows(h, dtype, interpret)
    s_ref[...] = s[None, :]


@functools.partial(jax.jit, static_argnames=("group", "out_dtype", "dtype", "interpret"))
def combine_quantize_triton(o_BJHC, lse_BJK64, v_scale_K, *, group: int, out_dtype,
                            dtype=jnp.float8_e4m3fn, interpret=False) -> QArray:  # fmt: skip
    """Decode attention's output for the o_proj GEMM as one GPU kernel: QArray ``[B, H·C]`` of
    ``quantize_activations((combine_splits(o, lse) · v_scale).astype(out_dtype))``.

    ``o_BJHC``: f32 chunk outputs; ``lse_BJK64``: f32, the Mosaic kernel's raw log-sum-exp
    tiles (None when J = 1); ``v_scale_K``: f32 [K] (the static V scale per KV head, read by
    the group's heads: no per-head copy to launch). The swap-AB kernel's outputs come as they
    are, ``[B, J, K, C, N]`` and lse ``[B, J, K, N]`` (``decode_attention.mgpu_swap``): each
    program reads its head's strided column, so no transpose runs before this launch.
    """
    if (reason := combine_supports(o_BJHC.shape, out_dtype)) is not None:
        raise ValueError(f"combine_quantize_triton: {reason}")
    swapped = o_BJHC.ndim == 5
    b, j, c = o_BJHC.shape[0], o_BJHC.shape[1], o_BJHC.shape[3]
    h = o_BJHC.shape[2] * (group if swapped else 1)
    if (lse_BJK64 is None) != (j == 1):
        raise ValueError(f"combine_quantize_triton: lse must be given iff J={j} > 1")
    dtype = fp8_dtype(dtype)
    if swapped:
        specs = [pl.BlockSpec((ROWS, j, 1, c, 1), lambda i, hh: (i, 0, hh // group, 0, hh % group))]
    else:
        specs = [pl.BlockSpec((ROWS, j, 1, c), lambda i, hh: (i, 0, hh, 0))]
    operands = [o_BJHC]
    if j > 1:
        width = lse_BJK64.shape[-1]  # LSE_TILE, or the swapped kernel's N
        specs.append(pl.BlockSpec((ROWS, j, 1, width), lambda i, hh: (i, 0, hh // group, 0)))
        operands.append(lse_BJK64)
    if v_scale_K.shape != (h // group,):
        raise ValueError(
            f"combine_quantize_triton: v_scale {v_scale_K.shape} is not [K]={h // group}"
        )
    specs.append(pl.BlockSpec((1, 1), lambda i, hh: (hh // group, 0)))
    operands.append(v_scale_K.astype(F32).reshape(h // group, 1))
    values, scales_HB = pl.pallas_call(
        functools.partial(
            _combine_kernel,
            group=group,
            splits=j,
            swapped=swapped,
            out_dtype=jnp.dtype(out_dtype),
            dtype=dtype,
            interpret=interpret,
        ),  # fmt: skip
        grid=(b // ROWS, h),
        in_specs=specs,
        out_specs=[
            pl.BlockSpec((ROWS, c), lambda i, hh: (i, hh)),
            pl.BlockSpec((1, ROWS), lambda i, hh: (hh, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, h * c), dtype), jax.ShapeDtypeStruct((h, b), F32)],
        interpret=interpret,
        compiler_params=_params(4, interpret),
        name="combine_quantize_triton",
    )(*operands)
    return _qarray(values, scales_HB, out_dtype)
