"""Blockwise FP8 W8A8 matmul for TPU with Pallas Mosaic TPU, in MXU-sized tiles.

Grid (m, n, k) over output tiles [block_m, block_n] and K tiles of ``block_k`` (multiples of the
128 scale group). FP8 tiles travel HBM -> VMEM as one byte per value. Per 128-wide K group the
kernel runs one MXU product ``[block_m, 128] x [128, block_n]`` with f32 results and promotes it
into an f32 VMEM accumulator with its scales, one 128-column slice at a time:
``acc[:, c] += (x̂_g · ŵ_{c,g}ᵀ) * (s_x[:, g] * s_w[c, g])``. The weight is ``[N, K]`` (the
QArray weight convention), so both operands contract on their lane (last) axis.

Where the chip's MXU takes FP8 (v6e and later: at the BF16 rate) the FP8 tiles go straight into
``dot_general``; elsewhere (v5e: no FP8 MXU) they are upcast in VMEM to BF16, which holds every
E4M3 and E5M2 value exactly. Either way each product and sum is exact up to f32 rounding, so the
numerics are the reference's.

A 128-deep dot fills half of a v6e MXU (256 x 256 arrays), so prefill tiles there are MXU-bound
at half the BF16 rate (perf_model.tpu: 0.51x XLA's BF16 matmul). ``compute_dtype="dequant_bf16"``
(the default for row tiles of >= 256 on an FP8-MXU chip) instead writes ``x̂ · s_x`` and
``ŵ · s_w`` to BF16 VMEM tiles and runs one ``block_k``-deep dot per step (predicted 1.02-1.03x at
M >= 4096). The BF16 rounding of each dequantized element is exact when the scales are powers
of two (``QuantRecipe(pow2_scales=True)``: 4 significant bits times 2^e) and otherwise adds at
most 2^-9 relative error per operand element, 32x below E4M3's own step (the XLA path's
``dequant_bf16`` on GPU makes the same trade).

Operand layout prepared by ``fp8_matmul_tpu`` (the TPU block rule: the last two block dims
divisible by (8, 128) or equal to the array's; kernels_wave2 §0 #4):
  * ``s_x``: [K/block_k, M_pad, block_k/128] f32, blocks ``(None, block_m, G)`` in VMEM;
  * ``s_w``: [N/block_n, 1, (block_n/128)·(K/128)] f32, a free reshape of the QArray's
    [N/128, K/128] scales, blocks ``(None, 1, ...)`` in SMEM: the N tile's block scales, read as
    scalars (index ``c·K/128 + k-group``). The block index changes only with the N tile, and SMEM
    holds ``4 (block_n/128)(K/128)`` bytes per buffer, so ``block_n`` is free of the 128 scale
    block: tiles are 512 x 1024 x 1024 for prefill and up to the whole K for decode.

Block shapes (``plan``; anchor: vllm-project/tpu-inference ``quantized_matmul/blockwise_kernel.py``
and its tuned sizes, ~1024 x 3072-5120 x 512-4096 for FP8): jax's TPU matmul guide measures each
grid step at ~0.35 us and 512 x 1024 x 1024 bf16 tiles at 78% of the v5e peak against 6% for
128^3. The scoped VMEM limit is raised to fit (v5e and v6e have 128 MiB of VMEM).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.qarray import QArray

GROUP = 128  # K group of activation scales, and both block dims of weight scales
VMEM_BYTES = 48 * 2**20  # tile budget; the scoped limit is raised to cover it
VMEM_LIMIT_BYTES = 64 * 2**20  # of 128 MiB physical on v5e / v6e
MAX_GROUPS = 32  # K groups unrolled per grid step (block_k <= 4096)
COMPUTE_DTYPES = ("bfloat16", "float32", "native", "dequant_bf16")
DEQUANT_MIN_ROWS = 256  # dequant_bf16 by default on an FP8-MXU chip for row tiles this tall


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """Tile configuration of the TPU kernel (a static argument); None: the per-shape default."""

    block_m: int | None = None  # rows per tile, a multiple of 32 (rounded down to the padded M)
    block_n: int | None = None  # a multiple of 128 dividing N
    block_k: int | None = None  # K per grid step: the largest multiple of 128 <= it dividing K
    # "native": FP8 straight into the MXU (v6e+); "bfloat16" / "float32": upcast in VMEM first
    # (lossless); "dequant_bf16": x̂·s_x and ŵ·s_w rounded to BF16 in VMEM, then one dot as deep
    # as block_k (exact with power-of-two scales, else <= 2^-9 relative per operand element);
    # None: dequant_bf16 for prefill tiles (>= DEQUANT_MIN_ROWS rows) on an FP8-MXU chip,
    # native for its decode tiles, bfloat16 elsewhere.
    compute_dtype: str | None = None
    # K groups per MXU dot (1 or 2); 2 stacks two groups' rows block-diagonally into one 256-deep
    # dot (decode on a 256x256 FP8 MXU); None: 2 for native decode tiles, else 1.
    pack: int | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """Resolved block shapes of one problem."""

    block_m: int
    block_n: int
    block_k: int
    compute_dtype: str  # one of COMPUTE_DTYPES
    pack: int = 1  # K groups per MXU dot

    @property
    def fp8_mxu(self) -> bool:
        return self.compute_dtype == "native"

    @property
    def dequant(self) -> bool:
        return self.compute_dtype == "dequant_bf16"


def has_fp8_mxu(device_kind: str) -> bool:
    """True for TPU generations whose MXU multiplies FP8 operands (v6e "TPU v6 lite", v7)."""
    kind = device_kind.lower()
    return "tpu" in kind and ("v6" in kind or "7x" in kind or "v7" in kind)


def largest_divisor(total: int, cap: int, step: int = GROUP) -> int:
    """The largest multiple of ``step`` <= ``cap`` dividing ``total`` (``step`` if none)."""
    return max((b for b in range(step, max(cap, step) + 1, step) if total % b == 0), default=step)


def _default_block_n(n: int, k: int, block_m: int, block_k: int, m_tiles: int) -> int:
    if m_tiles > 1 or block_m > 64:
        return largest_divisor(n, 1024)  # prefill: 1024-wide tiles (x re-read N/1024 times)
    # decode: weight tiles of <= 4 MiB and >= 4 grid steps when N allows (the first DMA is
    # exposed; each step costs ~0.35 us)
    cap = min(2048, max(GROUP, (4 * 2**20) // block_k))
    bn = largest_divisor(n, cap)
    while bn > 256 and (n // bn) * (k // block_k) < 4 and largest_divisor(n, bn // 2) < bn:
        bn = largest_divisor(n, bn // 2)
    return bn


def compute_mode(compute_dtype: str | None, fp8_mxu: bool, rows: int) -> str:
    """The compute dtype a plan runs (``TpuConfig.compute_dtype``'s rule), for row tiles of
    ``rows``: an explicit one as given; else ``dequant_bf16`` for prefill tiles on an FP8-MXU chip,
    ``native`` for its decode tiles, ``bfloat16`` on a chip without an FP8 MXU."""
    if compute_dtype is not None:
        return compute_dtype
    if not fp8_mxu:
        return "bfloat16"
    return "dequant_bf16" if rows >= DEQUANT_MIN_ROWS else "native"


PACK_DEQUANT = "pack=2 needs compute_dtype 'native' or an upcast (dequant_bf16 runs one deep dot)"


def plan(m: int, k: int, n: int, cfg: TpuConfig | None, *, fp8_mxu: bool,
         interpret: bool = False) -> Plan | str:  # fmt: skip
    """The block shapes for this problem, or why the kernel cannot take it. ``fp8_mxu``: the
    target's MXU takes FP8 (the default compute dtype is then "native"); interpret mode runs an
    explicit "native" anywhere."""
    cfg = cfg or TpuConfig()
    if k % GROUP or k == 0:
        return f"K={k} must be a positive multiple of {GROUP}"
    if n % GROUP or n == 0:
        return f"N={n} must be a positive multiple of {GROUP}"
    if m < 1:
        return "M must be >= 1"
    if cfg.compute_dtype not in (None, *COMPUTE_DTYPES):
        return f"compute_dtype must be one of {COMPUTE_DTYPES}, got {cfg.compute_dtype!r}"
    for name in ("block_m", "block_n", "block_k"):
        b = getattr(cfg, name)
        unit = 32 if name == "block_m" else GROUP  # 8-bit sublane tiles are 32 rows
        if b is not None and (b <= 0 or b % unit):
            return f"{name}={b} must be a positive multiple of {unit}"
    m32 = pl.cdiv(m, 32) * 32
    # On an FP8-MXU chip (256-deep arrays) a 128-deep per-group dot fills half an array: prefill
    # tiles dequantize to BF16 and run one block_k-deep dot instead, 1024 x 1024 x 1024 (30 MB
    # of VMEM; perf_model.tpu: v6e 0.51x -> 1.02-1.03x XLA's BF16 matmul at M >= 4096; 1024 x
    # 2048 would give 1.07-1.10x but needs ~53 MiB, over the 48 MiB tile budget).
    compute = compute_mode(cfg.compute_dtype, fp8_mxu, min(cfg.block_m or 1024, m32))
    dequant = compute == "dequant_bf16"
    block_m = min(cfg.block_m or (1024 if dequant else 512), m32)
    decode = m32 <= block_m and block_m <= 64
    block_k = largest_divisor(k, cfg.block_k or (MAX_GROUPS * GROUP if decode else 1024))
    if block_k // GROUP > MAX_GROUPS:
        return f"block_k={block_k} unrolls more than {MAX_GROUPS} K groups per step"
    m_tiles = pl.cdiv(m, block_m)
    block_n = cfg.block_n or _default_block_n(n, k, block_m, block_k, m_tiles)
    if n % block_n:
        return f"N={n} must be a multiple of block_n={block_n}"
    if compute == "native" and not (fp8_mxu or interpret):
        return "compute_dtype='native' needs a chip with an FP8 MXU (v6e or later)"
    # Two groups per 256-deep dot pay off while 2 block_m rows fit the 256-row weight-load time.
    few_rows = m_tiles == 1 and block_m <= 2 * GROUP
    pack = cfg.pack or (2 if compute == "native" and few_rows and block_k % (2 * GROUP) == 0 else 1)
    if pack == 2 and dequant:
        return PACK_DEQUANT
    if pack not in (1, 2):
        return f"pack={pack} must be 1 or 2"
    if pack == 2 and (m_tiles > 1 or block_k % (2 * GROUP)):
        return "pack=2 needs one M tile and block_k % 256 == 0"
    p = Plan(block_m, block_n, block_k, compute, pack)
    if (used := vmem_bytes(p)) > VMEM_BYTES:
        return f"tiles need ~{used} B of VMEM > {VMEM_BYTES} B (smaller blocks)"
    return p


def plan_name(p: Plan) -> str:
    """A resolved plan's name in the autotuner's records: ``tpu:BMxBNxBK/<compute>/p<pack>``."""
    return f"tpu:{p.block_m}x{p.block_n}x{p.block_k}/{p.compute_dtype}/p{p.pack}"


def neighbours(p: Plan, cfg_cls, fp8_mxu: bool) -> list:
    """Tile configs (``cfg_cls``: this kernel's or the grouped kernel's ``TpuConfig``) one step
    from the resolved plan ``p``, for the on-device autotuner: on an FP8-MXU chip the other
    compute modes (pack left to the plan), then ``block_n``, ``block_m`` and ``block_k`` halved
    and doubled and the other pack, each with the rest of ``p`` pinned. Unchecked: the caller
    keeps the ones its ``plan`` accepts, once per distinct plan."""
    pinned = dict(block_m=p.block_m, block_n=p.block_n, block_k=p.block_k,
                  compute_dtype=p.compute_dtype, pack=p.pack)  # fmt: skip
    out = [dict(pinned, compute_dtype=c, pack=None)
           for c in (("native", "dequant_bf16", "bfloat16") if fp8_mxu else ())
           if c != p.compute_dtype]  # fmt: skip
    for field in ("block_n", "block_m", "block_k"):
        out += [dict(pinned, **{field: v}) for v in (pinned[field] // 2, pinned[field] * 2)]
    out.append(dict(pinned, pack=3 - p.pack))
    return [cfg_cls(**kw) for kw in out]


def distinct_plans(first: Plan, cfgs, plan_of, limit: int) -> list[tuple[object, Plan]]:
    """(config, its plan) for the first ``limit`` of ``cfgs`` whose plan (``plan_of``: the
    kernel's ``plan`` at the shape) is accepted and differs from ``first`` and from the ones
    before: the autotuner's candidates beside the default plan ``first``."""
    out, seen = [], {first}
    for cfg in cfgs:
        if len(out) >= limit:
            break
        p = plan_of(cfg)
        if not isinstance(p, str) and p not in seen:
            seen.add(p)
            out.append((cfg, p))
    return out


def tiles(m: int, k: int, n: int, cfg: TpuConfig | None, interpret: bool = False) -> Plan | str:
    """``plan`` for the target device (the support check's half that reads shapes)."""
    return plan(m, k, n, cfg, fp8_mxu=target_has_fp8_mxu(), interpret=interpret)


def vmem_bytes(p: Plan, out_itemsize: int = 4) -> int:
    """VMEM of one grid step, generously: double-buffered x, w, s_x (lanes padded to 128) and
    output blocks, the f32 accumulator, one f32 product and the upcast operands of one group."""
    bm, bn, bk = p.block_m, p.block_n, p.block_k
    ins = p.pack**2 * bm * bk + bn * bk + bm * GROUP * 4
    upcast = 0 if p.fp8_mxu else (bm + bn) * GROUP * 4
    if p.dequant:  # the BF16 operand tiles (scratch) and one f32 product
        upcast = (bm + bn) * bk * 2 + bm * bn * 4
    return 2 * ins + 2 * bm * bn * out_itemsize + 2 * bm * bn * 4 + upcast


def promote(acc_ref, part, sx_g, sw_ref, kg, n_cols: int, k_groups: int):
    """``acc += part * s_x[:, g] * s_w[c, g]``, one 128-column weight-scale block at a time."""
    for c in range(n_cols):
        sl = slice(c * GROUP, (c + 1) * GROUP)
        acc_ref[:, sl] += part[:, sl] * (sx_g * sw_ref[0, c * k_groups + kg])


def accumulate(x_ref, sx_ref, w_ref, sw_ref, acc_ref, k, *, n_groups, n_cols, k_groups,
               compute_dtype, pack):  # fmt: skip
    """One K tile into the f32 accumulator: an MXU dot per ``pack`` K groups, then promotion."""
    bm = acc_ref.shape[0]
    for d in range(n_groups // pack):  # static unroll over the MXU dots of this K tile
        cols = slice(d * pack * GROUP, (d + 1) * pack * GROUP)
        # pack 2: x_ref[d] is [[x̂_g, 0], [0, x̂_g+1]] ([2 bm, 256]), so one 256-deep dot yields
        # both groups' products, stacked by rows (the zeros add exact zeros).
        x_d, w_d = (x_ref[d] if pack > 1 else x_ref[:, cols]), w_ref[:, cols]
        if compute_dtype is not None:  # no FP8 MXU: lossless upcast in VMEM
            x_d, w_d = x_d.astype(compute_dtype), w_d.astype(compute_dtype)
        part = jax.lax.dot_general(
            x_d, w_d, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        for h in range(pack):
            g = d * pack + h
            promote(acc_ref, part[h * bm : (h + 1) * bm], sx_ref[:, g : g + 1], sw_ref,
                    k * n_groups + g, n_cols, k_groups)  # fmt: skip


def accumulate_dequant(x_ref, sx_ref, w_ref, sw_ref, acc_ref, xs_ref, ws_ref, k, *, n_groups,
                       n_cols, k_groups):  # fmt: skip
    """One K tile as one deep dot: x̂·s_x per (row, group) and ŵ·s_w per 128x128 block written
    to BF16 VMEM tiles, then ``acc += xs · wsᵀ`` (f32 MXU accumulation over all of block_k)."""
    for g in range(n_groups):
        gs = slice(g * GROUP, (g + 1) * GROUP)
        xs_ref[:, gs] = (x_ref[:, gs].astype(jnp.float32) * sx_ref[:, g : g + 1]).astype(
            xs_ref.dtype
        )

    def dequant_rows(c, carry):  # one 128-row band of the weight tile, all its K groups
        rows = pl.ds(pl.multiple_of(c * GROUP, GROUP), GROUP)
        for g in range(n_groups):
            gs = slice(g * GROUP, (g + 1) * GROUP)
            s = sw_ref[0, c * k_groups + k * n_groups + g]
            ws_ref[rows, gs] = (w_ref[rows, gs].astype(jnp.float32) * s).astype(ws_ref.dtype)
        return carry

    jax.lax.fori_loop(0, n_cols, dequant_rows, 0)
    acc_ref[...] += jax.lax.dot_general(
        xs_ref[...], ws_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )


def accumulate_tile(x_ref, sx_ref, w_ref, sw_ref, acc_ref, scratch, k, *, dequant, n_groups,
                    n_cols, k_groups, compute_dtype, pack):  # fmt: skip
    """One K tile by the plan's method: ``accumulate_dequant`` (``scratch``: its two BF16 tiles)
    or ``accumulate`` (per-group dots and promotion)."""
    shape = dict(n_groups=n_groups, n_cols=n_cols, k_groups=k_groups)
    if dequant:
        accumulate_dequant(x_ref, sx_ref, w_ref, sw_ref, acc_ref, *scratch, k, **shape)
    else:
        accumulate(x_ref, sx_ref, w_ref, sw_ref, acc_ref, k, **shape,
                   compute_dtype=compute_dtype, pack=pack)  # fmt: skip


def _kernel(x_ref, sx_ref, w_ref, sw_ref, out_ref, acc_ref, *scratch, **static):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    accumulate_tile(x_ref, sx_ref, w_ref, sw_ref, acc_ref, scratch, k, **static)

    @pl.when(k == pl.num_programs(2) - 1)
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def block_diagonal_pairs(x_MK: jax.Array) -> jax.Array:
    """[M, K] -> [K/256, 2M, 256]: pair p holds ``[[x̂_2p, 0], [0, x̂_2p+1]]`` (128-wide groups),
    built exactly (FP8 values times 1 or 0)."""
    m, k = x_MK.shape
    x4 = x_MK.astype(jnp.float32).reshape(m, k // (2 * GROUP), 2, GROUP).transpose(1, 2, 0, 3)
    pairs = jnp.einsum("phmc,hq->phmqc", x4, jnp.eye(2, dtype=jnp.float32))
    return pairs.reshape(k // (2 * GROUP), 2 * m, 2 * GROUP).astype(x_MK.dtype)


def target_has_fp8_mxu() -> bool:
    from kernels_pallas.backend import target_device

    return has_fp8_mxu(target_device().device_kind)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config"))
def fp8_matmul_tpu(
    x_q: QArray,
    w_q: QArray,
    *,
    out_dtype=jnp.bfloat16,
    interpret: bool | pltpu.InterpretParams = False,
    config: TpuConfig | None = None,
) -> jax.Array:
    """``y = Σ_g s_x[:, g] s_w[:, g] (x̂[:, g] · ŵ[:, g]ᵀ)`` with an f32 VMEM accumulator.

    ``x_q``: QArray [M, K] with (128,) groups; ``w_q``: QArray [N, K] with (128, 128) blocks.
    Needs K % 128 == 0 and N % 128 == 0; M is padded to the row tile here.
    """
    if tuple(w_q.block_shape) != (GROUP, GROUP) or tuple(x_q.block_shape) != (GROUP,):
        raise ValueError(
            f"fp8_matmul_tpu: needs ({GROUP},) activation groups and ({GROUP}, {GROUP}) weight "
            f"blocks, got {x_q.block_shape} and {w_q.block_shape}"
        )
    (m, k), n = x_q.shape, w_q.shape[0]
    p = tiles(m, k, n, config, interpret=bool(interpret))
    if isinstance(p, str):
        raise ValueError(f"fp8_matmul_tpu: {p}")
    bm, bn, bk = p.block_m, p.block_n, p.block_k
    m_pad = pl.cdiv(m, bm) * bm
    n_groups, k_groups = bk // GROUP, k // GROUP
    x = jnp.pad(x_q.values, ((0, m_pad - m), (0, 0)))
    if p.pack > 1:
        x = block_diagonal_pairs(x)
    # [M, K/128] -> [K/block_k, M_pad, G]: one (block_m, G) scale tile per grid step.
    sx = jnp.pad(x_q.scales, ((0, m_pad - m), (0, 0)))
    sx = sx.reshape(m_pad, k // bk, n_groups).transpose(1, 0, 2)
    sw = w_q.scales.reshape(n // bn, 1, (bn // GROUP) * k_groups)
    compute = None if (p.fp8_mxu or p.dequant) else jnp.dtype(p.compute_dtype)
    kernel = functools.partial(_kernel, n_groups=n_groups, n_cols=bn // GROUP, k_groups=k_groups,
                               compute_dtype=compute, pack=p.pack, dequant=p.dequant)  # fmt: skip
    dequant_tiles = [pltpu.VMEM((bm, bk), jnp.bfloat16), pltpu.VMEM((bn, bk), jnp.bfloat16)]
    if p.pack > 1:
        x_spec = pl.BlockSpec((bk // (2 * GROUP), 2 * bm, 2 * GROUP), lambda i, j, kk: (kk, 0, 0))
    else:
        x_spec = pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk))
    y = pl.pallas_call(
        kernel,
        grid=(m_pad // bm, n // bn, k // bk),
        in_specs=[
            x_spec,
            pl.BlockSpec((None, bm, n_groups), lambda i, j, kk: (kk, i, 0)),
            pl.BlockSpec((bn, bk), lambda i, j, kk: (j, kk)),
            pl.BlockSpec(
                (None, 1, sw.shape[2]), lambda i, j, kk: (j, 0, 0), memory_space=pltpu.SMEM
            ),  # fmt: skip
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m_pad, n), jnp.dtype(out_dtype)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32), *(dequant_tiles if p.dequant else [])],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT_BYTES,
        ),
        interpret=interpret,
    )(x, sx, w_q.values, sw)
    return y[:m]
