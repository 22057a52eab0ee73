"""Per-token 1x128 FP8 quantization of activations as one Pallas (Triton) kernel on NVIDIA GPUs.

At decode sizes every XLA fusion is a launch, and XLA splits ``quantize_activations`` (amax
reduce, scale, cast, and the scale transpose the Hopper GEMM reads) into two to four fusions
behind each FP8 GEMM's producer (the compiled H100 rollout program:
``experiments/results/rollout_launches.json``). This kernel does all of it in one launch and
writes the layout ``fp8_matmul_mgpu`` reads: values padded with zero rows to the GEMM's row
tile, scales ``[K/128, rows]`` (returned as the transposed view of a QArray, which the GEMM
transposes back: XLA cancels the pair). Same arithmetic as ``quantize_activations`` compiled by
XLA on the same device, bit for bit: ``s = max(amax, tiny) · rn(1 / fp8_max)`` (XLA's algebraic
simplifier turns a division by a constant into that product on every backend),
``x̂ = cast(clamp(x · (fp8_max / max(amax, tiny))))`` with XLA's f32 division (``div_xla``:
``div.full.f32`` on NVIDIA GPUs, IEEE on the CPU). An H200 run with IEEE ``div.rn.f32`` here
differed from XLA in 40% of the scales and 0.04-0.09% of the codes (values on a rounding tie).

One program quantizes ``row_block(rows)`` rows x one 128-column group: 16 for decode batches
(more programs for few rows; Triton blocks are powers of two and the decode row tiles,
``mgpu_config.decode_config``, are multiples of 32), 64 above (16 KB of BF16 per program). At
every M it reads x once: XLA compiles ``quantize_activations`` into an amax fusion and a cast
fusion that both read x (and a third for the scales), 1.7x the bytes of this kernel (the
deviceless H100 compile at M = 4096; on the H200 they took 31 us at [4096, 4096], 83 us at
[4096, 12288], 2.7-3.0 TB/s over those bytes: ``experiments/results/gpu_h200_2026-12-04``).
Pallas' Triton backend, not Mosaic GPU: Mosaic GPU's layouts reduce rows of 64-row register
tiles, and a decode step has 1-64 rows (padding them to 64 would be one more launch). jax 0.12
deprecates the Triton backend; where it is gone ``supports`` says so and ``fp8_matmul``
quantizes with XLA again.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # deprecated in jax 0.12 (removal announced, no date): without it, XLA quantizes
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - a jax without the Pallas Triton backend
    pltriton = None

from kernels_pallas.qarray import SCALE_TINY, QArray, fp8_dtype, fp8_max
from kernels_pallas.quantize import inverse_fp8_max

ROWS = 16  # the row multiple every kernel of this package takes
DECODE_ROWS = 256  # up to here, ROWS rows per program: decode batches, where programs are few
GROUP = 128


def row_block(rows: int) -> int:
    """Rows per program for ``rows`` (a multiple of ``ROWS``): ``ROWS`` up to ``DECODE_ROWS``,
    else the largest of 64 and 32 that divides ``rows`` (fewer, larger programs: a Triton
    program's start-up is paid per block), else ``ROWS``."""
    if rows > DECODE_ROWS:
        for r in (64, 32):
            if rows % r == 0:
                return r
    return ROWS


def div_xla(a: jax.Array, b: jax.Array, interpret: bool) -> jax.Array:
    """f32 ``a / b`` as XLA computes it on the backend the kernel runs on: ``div.full.f32`` (<= 2
    ulp) on NVIDIA GPUs, where XLA's NVPTX backend compiles every f32 division with
    ``-nvptx-prec-divf32=1`` (Triton's own f32 division is ``div.full`` too, by default, but
    not promised); the CPU's IEEE division in interpret mode."""
    if interpret:
        return a / b
    (out,) = pltriton.elementwise_inline_asm(
        "div.full.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )
    return out


def quantize_rows(x: jax.Array, dtype, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """f32 ``[R, GROUP]`` -> (FP8 values ``[R, GROUP]``, f32 scales ``[R]``): one group per row,
    ``quantize_activations``' arithmetic as XLA compiles it (every kernel of this package)."""
    den = jnp.maximum(jnp.max(jnp.abs(x), axis=1), SCALE_TINY)
    fmax = jnp.full(den.shape, fp8_max(dtype), jnp.float32)
    inv = div_xla(fmax, den, interpret)
    q = jnp.clip(x * inv[:, None], -fmax[:, None], fmax[:, None]).astype(dtype)
    return q, den * inverse_fp8_max(dtype)


def _kernel(x_ref, q_ref, s_ref, *, dtype, interpret: bool):
    q_ref[...], s = quantize_rows(x_ref[...].astype(jnp.float32), dtype, interpret)
    s_ref[...] = s[None, :]


def supports(x_shape: tuple[int, ...], rows: int, group_size: int = GROUP) -> str | None:
    """None if the kernel takes ``x [M, K]`` padded to ``rows``, else why not."""
    if pltriton is None:
        return "this jax has no Pallas Triton backend"
    if len(x_shape) != 2:
        return f"x must be [M, K], got shape {x_shape}"
    m, k = x_shape
    if group_size != GROUP:
        return f"group_size must be {GROUP}, got {group_size}"
    if k % GROUP or k == 0:
        return f"K={k} must be a positive multiple of {GROUP}"
    if rows % ROWS or rows < m or m < 1:
        return f"rows={rows} must be a multiple of {ROWS} and >= M={m} >= 1"
    return None


@functools.partial(jax.jit, static_argnames=("rows", "group_size", "dtype", "interpret"))
def quantize_activations_triton(
    x_MK: jax.Array,
    group_size: int = GROUP,
    dtype=jnp.float8_e4m3fn,
    *,
    rows: int | None = None,
    interpret: bool = False,
) -> QArray:
    """``quantize_activations(x_MK, group_size, dtype)`` with ``rows - M`` zero rows appended
    (``rows``: M rounded up to 16 by default), as one GPU kernel (module docstring).

    ``x_MK``: BF16, F16 or F32 ``[M, K]``; returns a QArray ``[rows, K]`` (the padded rows have
    zero values and the smallest scale).
    """
    m, k = x_MK.shape if x_MK.ndim == 2 else (0, 0)
    rows = rows if rows is not None else -(-m // ROWS) * ROWS
    if (reason := supports(x_MK.shape, rows, group_size)) is not None:
        raise ValueError(f"quantize_activations_triton: {reason}")
    dtype = fp8_dtype(dtype)
    x_pad = x_MK if rows == m else jnp.pad(x_MK, ((0, rows - m), (0, 0)))
    groups, r = k // GROUP, row_block(rows)
    values, scales_GR = pl.pallas_call(
        functools.partial(_kernel, dtype=dtype, interpret=interpret),
        grid=(rows // r, groups),
        in_specs=[pl.BlockSpec((r, GROUP), lambda i, g: (i, g))],
        out_specs=[
            pl.BlockSpec((r, GROUP), lambda i, g: (i, g)),
            pl.BlockSpec((1, r), lambda i, g: (g, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, k), dtype),
            jax.ShapeDtypeStruct((groups, rows), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="quantize_activations_triton",
    )(x_pad)
    return QArray(values, scales_GR.T, (GROUP,), jnp.dtype(x_MK.dtype))
