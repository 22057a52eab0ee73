"""The on-device autotuner's side of ``fp8_matmul``: what it times at a shape and how.

``tuning_specs``: the candidates (the XLA FP8 path, the Hopper kernel's tile configs the support
check accepts, the BF16 floor), cut by the performance model to the default, its twins and the
fastest others (``TUNE_LIMIT``); on a TPU the kernel's default plan and the plans one step from
it (``tpu_specs``); ``timed_specs``: each as ``fp8_matmul`` then runs it (raw x:
fused or quantized once, ``QuantizedOnce``); ``timed_program``: the GEMM and a consumer, as in
the rollout program; ``autotuned``: the cached choice (``kernels_pallas.autotune``), tuning it
on first use. ``api.fp8_matmul`` calls ``autotuned`` with ``impl="auto"`` and
``FP8RL_AUTOTUNE=1`` on a GPU/TPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas import autotune
from kernels_pallas.backend import target_device
from kernels_pallas.fp8_matmul import api, tile_choice
from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.fp8_matmul import pallas_tpu as tpu
from kernels_pallas.fp8_matmul.mgpu_config import fused_refuses
from kernels_pallas.qarray import QArray
from kernels_pallas.quantize import quantize_activations

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
    through ``quantized_once``."""

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
        fz = raw_x and api.fused_default(m, n, k, chip)  # the default runs fused
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
        specs += tpu_specs(m, n, k, device_kind, TUNE_LIMIT if limit is None else limit)
    return specs


def tpu_specs(m: int, n: int, k: int, device_kind: str, limit: int) -> list:
    """The TPU kernel's candidates: its default plan (no config) and up to ``limit - 1`` of the
    plans one step from it (``pallas_tpu.neighbours``) that ``plan`` accepts, each distinct."""
    fp8_mxu = tpu.has_fp8_mxu(device_kind)
    first = tpu.plan(m, k, n, None, fp8_mxu=fp8_mxu)
    specs = [("pallas_tpu", "pallas_tpu", None)]
    if isinstance(first, str):  # refused: the support check says why when it runs
        return specs
    near = tpu.neighbours(first, tpu.TpuConfig, fp8_mxu)
    plan_of = lambda cfg: tpu.plan(m, k, n, cfg, fp8_mxu=fp8_mxu)  # noqa: E731
    return specs + [(tpu.plan_name(p), "pallas_tpu", cfg)
                    for cfg, p in tpu.distinct_plans(first, near, plan_of, limit - 1)]  # fmt: skip


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
            return quantized_once(a, w_q, config, out_dtype, interpret) + r

        return jax.jit(once)
    return jax.jit(lambda a, b, r: api.fp8_matmul(a, w_q, out_dtype=out_dtype, impl=impl,
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
    if api.fused_default(m, n, k, chip):  # the fused default, and x quantized once beside it
        once = tile_choice.dispatch_config(m, n, k, chip=chip)
        return [*specs, (tile_choice.name(once) + ONCE_SUFFIX, "pallas_mosaic_gpu",
                         QuantizedOnce(once))]  # fmt: skip
    first = next((i for i, s in enumerate(specs) if s[1] == "pallas_mosaic_gpu"), None)
    if first is not None and fused_refuses(specs[first][2]) is None:  # explicit: it runs fused
        name, impl, _ = specs[first]
        specs[first] = (name, impl, None)  # time and replay the default path
    return specs


def autotuned(x2, w_q: QArray, out_dtype):
    """(impl, config) the on-device autotuner picked for this shape (tuning it now if new)."""
    dev = target_device()
    if dev.platform not in ("gpu", "tpu"):
        return "auto", None
    m, (n, k) = api._rows(x2), w_q.shape
    raw = not isinstance(x2, QArray) and x2.dtype in api._RAW_16BIT
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


def quantized_once(x2, w_q: QArray, choice: QuantizedOnce, out_dtype, interpret: bool = False):
    """``choice`` run: raw x [M, K] quantized once by ``act_quantize`` for its tile (rows padded
    to it), the Hopper kernel on that tile, the first M rows: as timed and as replayed."""
    xq = api._mgpu_quantized(x2, w_q, choice.config, interpret)
    y = api._run(xq, w_q, impl="pallas_mosaic_gpu", config=choice.config,
                 out_dtype=jnp.dtype(out_dtype), interpret=interpret)  # fmt: skip
    return y[: api._rows(x2)]
