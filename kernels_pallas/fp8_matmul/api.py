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
    device (``kernels_pallas.autotune``), cached per device kind, jax version and shape;
  * ``pallas_tpu``: the Mosaic TPU kernel.
The support checks are pure Python over shapes, dtypes, tile configs and the target device, and
are exact: ``aot_cases.py`` compiles what they accept at real shapes for H100 and TPU v5e/v6e.
"""

from __future__ import annotations

import dataclasses
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
    re-quantizing its x slice N/128 times over is issue-bound (725 instructions per K step
    against 128; 0.57-0.66x the quantize-once time at M 65-8192): the fused prefill tiles run
    only with an explicit config."""
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


# Pallas tile configs the on-device autotuner times per shape: the default and the ones the
# performance model ranks fastest. The first H200 run timed every legal config (~25 per shape,
# ~3.4 s each: a Mosaic GPU compile, a warm-up, CUPTI timing) and its 85-s stage ended inside
# the first shape; 6 (with XLA and the BF16 floor, 8 candidates) take ~27 s per shape at that
# rate. The model ranks, the device decides.
TUNE_LIMIT = 6
# The decode (swap-AB) default's twin with this many ring stages, always timed beside it. The
# first device run measured the decode tiles at 1.3-2.8 TB/s of the H200's 4.8, 1.28-2.56x the
# model's time then (1.00-1.31x since its latency and fill were fitted: ``calibration.fit``).
# They run 1 CTA per SM (registers) with 4 stages: 50-99 KB of TMA loads in flight per SM, which
# at ~1.2 us of loaded HBM latency is 40-80 GB/s per SM (Little's law), 1.1-2.2x an SM's 36 GB/s
# share of the peak: a thin margin that a deeper ring widens. 6 stages (the deepest
# ``mgpu_config`` allows) compile with 0 spills and the same registers on every swap tile (SASS:
# 8 more loop instructions), and SMEM is free at 1 CTA per SM. The default now widens each stage
# instead (two 128-K slices: ``mgpu_config._DECODE_K_SLICES``), 4 stages where they fit; the
# deeper ring stays a twin timed beside it until a device measures the difference.
DEEP_RING_STAGES = 6


@dataclasses.dataclass(frozen=True)
class QuantizedOnce:
    """The autotuner's quantize-once candidate with raw x where the default runs fused
    (``fused_default``): x quantized once by ``act_quantize``, then the QArray kernel on
    ``config`` (an explicit ``MgpuConfig`` with raw x would run fused). Timed and replayed
    through ``_quantized_once_choice``."""

    config: mgpu.MgpuConfig


ONCE_SUFFIX = "+quant:once"  # its spec's name: the FP8-x tile's name and this (bench_matmul's)


def tuning_specs(m: int, n: int, k: int, platform: str, limit: int | None = None,
                 device_kind: str = "",
                 raw_x: bool = False) -> list[tuple[str, str, object]]:  # fmt: skip
    """(name, impl, config) the autotuner times at [M, K] x [N, K] on ``platform``: the XLA FP8
    path, the Pallas kernel's tile configs the support check can accept, and the BF16 floor.
    ``limit`` (GPU): only the default config and the ``limit - 1`` others the performance model
    predicts fastest in a program (``perf_model.gpu``, on the H200's or H100's constants by
    ``device_kind``); None: every legal config. ``raw_x``: x arrives BF16/F16, so each config
    runs as ``fp8_matmul`` runs it then (the fused kernel where it takes the config: ``_fused``)
    and the default is the fused one where ``fused_default`` says."""
    specs = [("xla", "xla", None), (autotune.BF16_FLOOR, autotune.BF16_FLOOR, None)]
    if platform == "gpu":

        def legal(c) -> bool:
            fused = raw_x and fused_refuses(c) is None
            return mgpu.supports(m, k, n, c, fused=fused, x_itemsize=2 if fused else 1,
                                 out_itemsize=2) is None  # fmt: skip

        chip = tile_choice.chip_of(device_kind)
        fz = raw_x and fused_default(m, n, k, chip)  # the default runs fused
        cfgs = [tile_choice.dispatch_config(m, n, k, fused=fz, chip=chip)]

        # pinned beside a decode default: its one-slice-per-step tile (the default before
        # two-slice stages), and the deepest ring (DEEP_RING_STAGES) of the default if it
        # fits, else of the one-slice tile, where its K chunks have steps for the extra stages;
        # beside a tile the model chose over the rules (``tile_choice.dispatch_config``), the rules'
        def deeper(c):
            d = dataclasses.replace(c, max_concurrent_steps=DEEP_RING_STAGES)
            steps = k // c.k_block // c.split_k
            return d if legal(d) and steps > c.max_concurrent_steps else None

        twins = [mgpu.default_config(m, n, k, fused=fz)]
        if cfgs[0].swap_ab:
            one = mgpu.default_config(m, n, k, fused=fz, k_slices=False)
            deep = [d for c in (cfgs[0], one) if (d := deeper(c)) is not None]
            twins += [one, *deep[:1]]
        twins = [c for c in dict.fromkeys(twins) if c != cfgs[0]]
        cfgs += twins
        cfgs += tile_choice.candidates(m, n, k, legal, fz, pinned=tuple(cfgs))
        for cfg in dict.fromkeys(cfgs):
            if legal(cfg):
                specs.append((tile_choice.name(cfg), "pallas_mosaic_gpu", cfg))
        if limit is not None:
            specs = specs[:2] + _model_ranked(specs[2:], m, n, k, limit, device_kind,
                                              1 + len(twins), raw_x)  # fmt: skip
    elif platform == "tpu":
        specs.append(("pallas_tpu", "pallas_tpu", None))
    return specs


def _model_ranked(specs, m: int, n: int, k: int, limit: int, device_kind: str, pinned: int = 1,
                  raw_x: bool = False):  # fmt: skip
    """The first ``pinned`` specs (the default config, and for decode its twins) and
    the ``limit - pinned`` others the performance model predicts fastest as a GEMM inside a
    program, in the order given (with raw x: as ``fp8_matmul`` runs each, fused or not)."""
    from kernels_pallas.perf_model import gpu

    chip = tile_choice.chip_of(device_kind)

    def predicted(cfg) -> float:
        fused = raw_x and fused_refuses(cfg) is None
        x, mode = ("bf16", "fused" if fused else "qarray") if raw_x else ("fp8", "default")
        try:
            return gpu.predict_matmul(chip, m, n, k, x, mode=mode, config=cfg,
                                      in_program=True).time_s  # fmt: skip
        except KeyError:  # no SASS profile of this variant's family: rank it last
            return float("inf")

    rest = sorted(range(pinned, len(specs)), key=lambda i: (predicted(specs[i][2]), i))
    keep = {*range(pinned), *rest[: max(limit - pinned, 0)]}
    return [s for i, s in enumerate(specs) if i in keep]


def timed_program(impl: str, config, w_q: QArray, out_dtype, interpret: bool = False):
    """The program the autotuner times for one candidate: the GEMM and a consumer of its output
    (``y + r``, as the model's residual add or SiLU product), so that a split-K tile's sum of
    partials fuses into the consumer as it does in the rollout program, instead of costing a
    launch of its own (timed alone, the GEMM would charge split-K tiles that launch and bias the
    choice to unsplit tiles). ``fn(x, w, r)``: ``w`` is the BF16 weight ``[N, K]`` for the BF16
    floor, unused (None) for the FP8 candidates, which use ``w_q``."""
    if impl == autotune.BF16_FLOOR:
        return jax.jit(lambda a, b, r: jnp.dot(a, b.T, preferred_element_type=out_dtype) + r)
    if isinstance(config, QuantizedOnce):

        def once(a, b, r):
            del b  # the FP8 weight is w_q
            xq, m, cfg = _quantized_once_choice(a, w_q, config, interpret)
            return _fp8_matmul_2d(xq, m, cfg, w_q, out_dtype, interpret) + r

        return jax.jit(once)
    return jax.jit(lambda a, b, r: fp8_matmul(a, w_q, out_dtype=out_dtype, impl=impl,
                                              config=config, interpret=interpret) + r)  # fmt: skip


def timed_specs(m: int, n: int, k: int, platform: str, device_kind: str,
                raw_x: bool) -> list[tuple[str, str, object]]:  # fmt: skip
    """``tuning_specs`` (limited to ``TUNE_LIMIT``) with each config as the autotuner times and
    replays it through ``fp8_matmul``. With raw x an explicit config runs the fused kernel
    wherever it takes the tile (``_fused``), but the default path quantizes x once outside
    ``fused_default``'s rows: the default's spec then carries no config, so that it is timed
    and replayed as the default runs (the same tile, x quantized once). Where the default runs
    fused, every Pallas candidate does, so the quantize-once path joins them
    (``QuantizedOnce``: ``act_quantize``, then the FP8-x dispatch tile): the device, not the
    model alone, decides between the two at 16-64 rows."""
    specs = tuning_specs(m, n, k, platform, limit=TUNE_LIMIT, device_kind=device_kind,
                         raw_x=raw_x)  # fmt: skip
    if platform != "gpu" or not raw_x:
        return specs
    chip = tile_choice.chip_of(device_kind)
    if fused_default(m, n, k, chip):  # the fused default, and x quantized once beside it
        once = tile_choice.dispatch_config(m, n, k, chip=chip)
        return [*specs, (tile_choice.name(once) + ONCE_SUFFIX, "pallas_mosaic_gpu",
                         QuantizedOnce(once))]  # fmt: skip
    first = next((i for i, s in enumerate(specs) if s[1] == "pallas_mosaic_gpu"), None)
    if first is not None and fused_refuses(specs[first][2]) is None:  # explicit: it runs fused
        name, impl, _ = specs[first]
        specs[first] = (name, impl, None)  # time and replay the default path
    return specs


def _autotuned(x2, w_q: QArray, out_dtype):
    """(impl, config) the on-device autotuner picked for this shape (tuning it now if new)."""
    dev = target_device()
    if dev.platform not in ("gpu", "tpu"):
        return "auto", None
    m, (n, k) = _rows(x2), w_q.shape
    raw = not isinstance(x2, QArray) and x2.dtype in _RAW_16BIT
    specs = timed_specs(m, n, k, dev.platform, dev.device_kind, raw)
    shape = (m, n, k, str(w_q.values.dtype), str(out_dtype), isinstance(x2, QArray))
    key = autotune.key(dev.device_kind, jax.__version__, "fp8_matmul", shape)

    def candidates():
        from kernels_pallas.quantize import quantize_weight

        kx, kw = jax.random.split(jax.random.key(0))
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = jax.random.normal(kw, (n, k), jnp.bfloat16)
        xq, wq = quantize_activations(x, 128, w_q.values.dtype), quantize_weight(w.T)
        x_in = xq if isinstance(x2, QArray) else x
        r = jnp.zeros((m, n), out_dtype)
        out = []
        for name, impl, cfg in specs:
            fn = timed_program(impl, cfg, wq, out_dtype)
            a, b = (x, w) if impl == autotune.BF16_FLOOR else (x_in, None)
            run = lambda fn=fn, a=a, b=b: fn(a, b, r).block_until_ready()  # noqa: E731
            out.append(autotune.Candidate(name, impl, cfg, run))
        return out

    record = autotune.lookup_or_tune(key, candidates)
    chosen = {name: (impl, cfg) for name, impl, cfg in specs}
    return chosen.get(record["choice"], ("auto", None))


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
        impl, config = _autotuned(x2, w_q, out_dtype)
        if isinstance(config, QuantizedOnce):  # x quantized once, not fused: it was faster
            xq, m, cfg = _quantized_once_choice(x2, w_q, config, interpret)
            y = _fp8_matmul_2d(xq, m, cfg, w_q, out_dtype, interpret)
            return y.reshape(*x.shape[:-1], w_q.shape[0])
    chosen = IMPLEMENTATIONS.select(
        impl, x2, w_q, config=config, out_dtype=out_dtype, interpret=interpret
    )
    y = _run(x2, w_q, impl=chosen.name, config=config, out_dtype=out_dtype, interpret=interpret)
    return y.reshape(*x.shape[:-1], w_q.shape[0])


def _quantized_once_choice(x2, w_q: QArray, choice: QuantizedOnce, interpret: bool):
    """(x quantized once for ``choice``'s tile, its rows, the tile): the autotuner's
    ``QuantizedOnce`` pick, as timed and as replayed."""
    return _mgpu_quantized(x2, w_q, choice.config, interpret), _rows(x2), choice.config


def _fp8_matmul_2d(xq: QArray, m: int, config, w_q: QArray, out_dtype, interpret: bool):
    """The Hopper kernel on x quantized once (rows padded to the tile), its first ``m`` rows."""
    y = _run(xq, w_q, impl="pallas_mosaic_gpu", config=config, out_dtype=jnp.dtype(out_dtype),
             interpret=interpret)  # fmt: skip
    return y[:m]
