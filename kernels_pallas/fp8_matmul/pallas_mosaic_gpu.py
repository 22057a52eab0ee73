"""Blockwise FP8 W8A8 matmul for Hopper (sm_90) with Pallas Mosaic GPU.

DeepGEMM / CUTLASS example 67 structure: a warp-specialized pipeline (one TMA warpgroup, one or
two compute warpgroups) streams 128-wide K slices of ``x`` and ``w`` into an SMEM ring; each
compute warpgroup runs one FP8 wgmma per slice into a fresh f32 accumulator ``acc_k`` and
promotes it in registers: ``acc += acc_k * s_x[m, kb] * s_w[kb, n]``. Promoting every 128 K keeps
the tensor core's limited-precision FP8 accumulation short (DeepSeek-V3 §3.3.2).

Layout of the operands the kernel reads (prepared by ``fp8_matmul_mgpu``):
  * ``x``: FP8 [M_pad, K] (M padded to ``block_m``), or raw BF16/F32 [M_pad, K] when fused;
  * ``s_x^T``: f32 [K/128, M_pad] (transposed so one K step is one contiguous TMA row);
  * ``w``: FP8 [K, N];
  * ``s_w``: f32 [K/128, N], the 128x128 block scales repeated over each block's 128 columns,
    so the promotion is a row-vector times column-vector broadcast in the WGMMA layout. This costs
    1/32 of the weight bytes of extra traffic (4 bytes per 128 weight bytes).

Fused activation quantization (``fp8_matmul_mgpu_fused``): ``x`` arrives in BF16; each compute
warpgroup loads its [64, 128] slice from SMEM into registers, takes the row amax, computes
``s = max(amax, tiny) / fp8_max``, casts ``clip(x / s)`` to FP8 and stores it into a private
swizzled SMEM tile that feeds the wgmma. This removes the separate pass over ``x`` (one read of
BF16 x and one write + read of FP8 x) and is numerically the same formula as
``quantize_activations``. It is verified in GPU interpret mode only (see the tests).

Unproven here: real-hardware lowering and speed (no Hopper GPU was available when this was
written); GPU interpret mode checks semantics (TMA, barriers, wgmma math), not register layouts
or performance.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.qarray import SCALE_TINY, QArray, fp8_max

GROUP = 128  # K group of activation scales and K block of weight scales the kernel supports
_WGMMA_M = 64  # rows of one warpgroup's wgmma tile


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tile configuration of the Hopper kernel (a static argument)."""

    block_m: int = 128  # rows per CTA; split over the compute warpgroups (64 rows each)
    block_n: int = 128  # columns per CTA
    max_concurrent_steps: int = 4  # SMEM ring depth of the TMA pipeline (K steps in flight)

    @property
    def num_compute_wgs(self) -> int:
        return self.block_m // _WGMMA_M

    def validate(self) -> None:
        if self.block_m not in (64, 128):
            raise ValueError(f"MgpuConfig.block_m must be 64 or 128, got {self.block_m}")
        if self.block_n % 64 or not 64 <= self.block_n <= 256:
            raise ValueError(f"MgpuConfig.block_n must be 64, 128, 192 or 256, got {self.block_n}")
        if self.max_concurrent_steps < 2:
            raise ValueError("MgpuConfig.max_concurrent_steps must be >= 2")


def default_config(m: int, n: int) -> MgpuConfig:
    """Untuned defaults: decode (M <= 64) uses 64x64 CTAs, so N=7168 gives 112 CTAs to stream the
    weight (the memory-bound case wants many CTAs); otherwise 128x128 CTAs with 2 compute WGs."""
    if m <= 64:
        return MgpuConfig(block_m=64, block_n=64)
    return MgpuConfig(block_m=128, block_n=128 if n % 128 == 0 else 64)


def _smem_transforms(dtype, minor: int):
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _quantize_rows(x, fp8_dtype):
    """In-register 1x128 quantization of a [64, 128] tile: returns (x_fp8, scale per row)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=1)
    s = jnp.maximum(amax, SCALE_TINY) / fp8_max(fp8_dtype)
    m = fp8_max(fp8_dtype)
    xq = jnp.clip(x / lax.broadcast_in_dim(s, x.shape, [0]), -m, m).astype(fp8_dtype)
    return xq, s


def _kernel(x_gmem, sx_gmem, w_gmem, sw_gmem, out_gmem, *, cfg: MgpuConfig, fused: bool, wdt):
    """One CTA computes one [block_m, block_n] output tile over all K steps."""
    k = w_gmem.shape[0]
    out_dtype = out_gmem.dtype
    tm, tn = _WGMMA_M, cfg.block_n
    m_slice = pl.ds(lax.axis_index("m") * cfg.block_m, cfg.block_m)
    n_slice = pl.ds(lax.axis_index("n") * tn, tn)
    in_specs = [
        plgpu.BlockSpec(
            (cfg.block_m, GROUP),
            lambda kk: (0, kk),
            transforms=_smem_transforms(x_gmem.dtype, GROUP),
        ),
        plgpu.BlockSpec((GROUP, tn), lambda kk: (kk, 0), transforms=_smem_transforms(wdt, tn)),
    ]
    if not fused:
        in_specs.append(plgpu.BlockSpec((1, cfg.block_m), lambda kk: (kk, 0)))
    in_specs.append(plgpu.BlockSpec((1, tn), lambda kk: (kk, 0)))

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k // GROUP,),
            memory_registers=40,
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=cfg.num_compute_wgs,
            max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None
    gmem_in = [x_gmem.at[m_slice, :], w_gmem.at[:, n_slice]]
    if not fused:
        gmem_in.append(sx_gmem.at[:, m_slice])
    gmem_in.append(sw_gmem.at[:, n_slice])
    scratch = dict(
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(*gmem_in),
        out_smem=plgpu.SMEM(
            (cfg.num_compute_wgs, tm, tn), out_dtype, transforms=_smem_transforms(out_dtype, tn)
        ),
        xq_smem=plgpu.SMEM(
            (cfg.num_compute_wgs, tm, GROUP), wdt, transforms=_smem_transforms(wdt, GROUP)
        )
        if fused
        else None,
    )

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(pipeline_allocs, out_smem, xq_smem):
        wg = lax.axis_index("wg")
        wg_rows = pl.ds(wg * tm, tm)

        def compute_context(eval_pipeline):
            acc0 = plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), plgpu.Layout.WGMMA)
            acc = eval_pipeline(acc0)
            out_smem[wg] = acc.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[m_slice, n_slice].at[wg_rows])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def body(_, x_smem, w_smem, *rest):
            *s_refs, acc = rest
            if fused:
                (sw_smem,) = s_refs
                xq, sx = _quantize_rows(x_smem[wg_rows, :], wdt)
                xq_smem[wg] = xq
                plgpu.commit_smem()  # make the register->SMEM stores visible to the wgmma
                lhs = xq_smem.at[wg]
            else:
                sx_smem, sw_smem = s_refs
                sx = sx_smem[0, wg_rows]
                lhs = x_smem.at[wg_rows]

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, lhs, w_smem)
                plgpu.wgmma_wait(0)
                return acc_ref[...]

            acc_k = pl.run_scoped(mma, plgpu.ACC((tm, tn), jnp.float32))
            sw = sw_smem[0, :]
            scale = lax.broadcast_in_dim(sx, (tm, tn), [0]) * lax.broadcast_in_dim(
                sw, (tm, tn), [1]
            )
            return acc + acc_k * scale

        get_pipeline(body, compute_context)(*gmem_in, allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _check_shapes(m: int, k: int, n: int, cfg: MgpuConfig) -> None:
    cfg.validate()
    if k % GROUP:
        raise ValueError(f"fp8_matmul_mgpu: K={k} must be a multiple of {GROUP}")
    if n % cfg.block_n:
        raise ValueError(f"fp8_matmul_mgpu: N={n} must be a multiple of block_n={cfg.block_n}")
    if m < 1:
        raise ValueError("fp8_matmul_mgpu: M must be >= 1")


def _check_weight(w_q: QArray) -> None:
    if tuple(w_q.block_shape) != (GROUP, GROUP):
        raise ValueError(
            f"fp8_matmul_mgpu: weight blocks must be ({GROUP}, {GROUP}), got {w_q.block_shape}"
        )
    if w_q.ndim != 2:
        raise ValueError(f"fp8_matmul_mgpu: w_q must be rank 2 [K, N], got shape {w_q.shape}")


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    return (
        a
        if a.shape[0] == rows
        else jnp.pad(a, ((0, rows - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))
    )


def _call(x, sx_t, w, sw, *, out_dtype, cfg: MgpuConfig, fused: bool, interpret: bool):
    m_pad, n = x.shape[0], w.shape[1]
    kern = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg, fused=fused, wdt=w.dtype),
        out_type=jax.ShapeDtypeStruct((m_pad, n), out_dtype),
        grid=(m_pad // cfg.block_m, n // cfg.block_n),
        grid_names=("m", "n"),
        num_threads=cfg.num_compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}),
    )
    return kern(x, sx_t, w, sw)


def _expand_w_scales(w_q: QArray) -> jax.Array:
    """[K/128, N/128] block scales -> [K/128, N] (one scale per output column per K block)."""
    n = w_q.shape[1]
    return jnp.repeat(w_q.scales, GROUP, axis=1, total_repeat_length=w_q.scales.shape[1] * GROUP)[
        :, :n
    ]


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config"))
def fp8_matmul_mgpu(
    x_q: QArray, w_q: QArray, *, out_dtype=jnp.bfloat16, interpret: bool = False, config=None
) -> jax.Array:
    """``y = Σ_kb s_x[:, kb] s_w[kb, :] (x̂[:, kb] @ ŵ[kb, :])`` on Hopper (see module docstring).

    ``x_q``: QArray [M, K] with (128,) groups; ``w_q``: QArray [K, N] with (128, 128) blocks.
    Needs K % 128 == 0 and N % block_n == 0; M is padded to ``block_m`` here.
    """
    _check_weight(w_q)
    if tuple(x_q.block_shape) != (GROUP,) or x_q.ndim != 2:
        raise ValueError(
            f"fp8_matmul_mgpu: x_q must be [M, K] with ({GROUP},) groups, got {x_q.block_shape}"
        )
    if x_q.values.dtype != w_q.values.dtype:
        raise ValueError(
            f"fp8_matmul_mgpu: x and w FP8 formats differ ({x_q.values.dtype} vs "
            f"{w_q.values.dtype}); quantize x to the weight's format"
        )
    (m, k), n = x_q.shape, w_q.shape[1]
    cfg = config or default_config(m, n)
    _check_shapes(m, k, n, cfg)
    m_pad = pl.cdiv(m, cfg.block_m) * cfg.block_m
    x = _pad_rows(x_q.values, m_pad)
    sx_t = _pad_rows(x_q.scales, m_pad).T  # padded rows: zero values and zero scales
    y = _call(
        x,
        sx_t,
        w_q.values,
        _expand_w_scales(w_q),
        out_dtype=jnp.dtype(out_dtype),
        cfg=cfg,
        fused=False,
        interpret=interpret,
    )
    return y[:m]


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config"))
def fp8_matmul_mgpu_fused(
    x: jax.Array, w_q: QArray, *, out_dtype=jnp.bfloat16, interpret: bool = False, config=None
) -> jax.Array:
    """As ``fp8_matmul_mgpu`` with raw BF16/F16 ``x`` [M, K] quantized per 1x128 group in-kernel."""
    _check_weight(w_q)
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"fp8_matmul_mgpu_fused: x must be a 2-D BF16/F16 array (F32 tiles would not fit "
            f"the SMEM ring), got {x.shape} {x.dtype}"
        )
    (m, k), n = x.shape, w_q.shape[1]
    if k != w_q.shape[0]:
        raise ValueError(f"fp8_matmul_mgpu_fused: contracting dims differ: {k} vs {w_q.shape[0]}")
    cfg = config or default_config(m, n)
    _check_shapes(m, k, n, cfg)
    m_pad = pl.cdiv(m, cfg.block_m) * cfg.block_m
    x = _pad_rows(x, m_pad)
    y = _call(
        x,
        None,
        w_q.values,
        _expand_w_scales(w_q),
        out_dtype=jnp.dtype(out_dtype),
        cfg=cfg,
        fused=True,
        interpret=interpret,
    )
    return y[:m]
