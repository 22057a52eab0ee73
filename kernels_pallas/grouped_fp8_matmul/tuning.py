"""On-device autotuning of the Hopper grouped FP8 kernel's tiles (the MoE experts).

The kernel's tiles are rules written without a device (``pallas_mosaic_gpu.default_config``:
swap-AB tiles of >= twice the mean group for decode-sized groups, wide 128x256 tiles with
ragged row stores above), which the performance model ranks (``perf_model.gpu_grouped``) but no
device has timed. With ``FP8RL_AUTOTUNE=1`` on a Hopper GPU, the first call of
``grouped_fp8_matmul`` with ``impl="auto"`` and no config at a shape times a few tiles around the
default and caches the fastest, as the decode attention kernels do (``attention_autotune``:
the same cache files, keyed by device kind, jax version, op and shape). Candidates
(``candidates``): the default first; for decode-sized groups the other swap-AB tiles of 32 / 64
rows x 64 / 128 weight rows at the default's ring depth, the default one stage deeper, and the
unswapped 128x128 tile; for prefill-sized groups 128x256, 128x128, 256x128 and the 64-row swap
tile. Each is timed on random operands of the call's shapes and dtypes with the rows spread
evenly over the experts (the routing is data: at trace time it is not known).

On a TPU (``FP8RL_AUTOTUNE=1``, ``impl="auto"``, no config, a real TPU) the TPU kernel's plans
are timed the same way (``tpu_candidates``): the default (each expert's weights kept in VMEM
across its row tiles where they fit), the streamed plan beside it (N tiles of <= 1024, K steps
of 1024), and the plans one step from the default (``fp8_matmul.pallas_tpu.neighbours``: compute
mode, block sizes halved and doubled, pack).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas import attention_autotune, autotune
from kernels_pallas.backend import target_device
from kernels_pallas.fp8_matmul.pallas_tpu import (
    distinct_plans,
    has_fp8_mxu,
    neighbours,
    plan_name,
)
from kernels_pallas.grouped_fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.grouped_fp8_matmul import pallas_tpu as tpu
from kernels_pallas.grouped_fp8_matmul.reference import stacks
from kernels_pallas.qarray import QArray

OP = "grouped_fp8_matmul"
TUNE_LIMIT = 6  # TPU plans timed per shape (the default among them)


def enabled_for(impl: str, config, interpret: bool, chosen: str = "pallas_mosaic_gpu") -> bool:
    """Whether a call tunes its tiles: autotuning on, ``impl="auto"``, no config, and the
    ``chosen`` kernel's real device (a Hopper GPU; a TPU for ``pallas_tpu``)."""
    platform = {"pallas_mosaic_gpu": "gpu", "pallas_tpu": "tpu"}.get(chosen)
    return platform is not None and attention_autotune.enabled_for(impl, config, interpret,
                                                                   platform)  # fmt: skip


def name(cfg: mgpu.MgpuConfig) -> str:
    swap = "/swap" if cfg.swap_ab else ""
    return f"{cfg.block_m}x{cfg.block_n}/st{cfg.max_concurrent_steps}{swap}"


def candidates(m: int, k: int, ns: tuple[int, ...], e: int, out_itemsize: int = 2) -> list:
    """The tiles timed at ``m`` rows of [m, k] over ``e`` experts' stacks of N ``ns``: the
    default first, then the others around it (module doc) that the support check accepts."""
    g = mgpu.MgpuConfig
    default = mgpu.default_config(m, ns, k, e, out_itemsize=out_itemsize)
    if default.swap_ab:
        st = default.max_concurrent_steps
        others = [g(bm, bn, st, True) for bm in (32, 64) for bn in (128, 64)]
        others += [dataclasses.replace(default, max_concurrent_steps=st + 1), g(128, 128, 4)]
    else:
        others = [g(128, 256, 3), g(128, 128, 4), g(256, 128, 3), g(64, 128, 4, True)]
    legal = [c for c in [default, *others]
             if mgpu.supports(m, k, ns, e, c, out_itemsize=out_itemsize) is None]  # fmt: skip
    return list(dict.fromkeys(legal))


def tpu_candidates(m: int, k: int, ns: tuple[int, ...], e: int, fp8_mxu: bool,
                   limit: int = TUNE_LIMIT) -> list:  # fmt: skip
    """The TPU kernel's plans timed at this shape (module doc): the default (``TpuConfig()``)
    first, the streamed plan, then its neighbours, each distinct plan once, at most ``limit``."""
    first = tpu.plan(m, k, ns, e, None, fp8_mxu=fp8_mxu)
    if isinstance(first, str):
        return []
    streamed = tpu.TpuConfig(block_n=min(tpu.largest_divisor(n, 1024) for n in ns),
                             block_k=1024)  # fmt: skip
    near = [streamed, *neighbours(first, tpu.TpuConfig, fp8_mxu)]
    plan_of = lambda cfg: tpu.plan(m, k, ns, e, cfg, fp8_mxu=fp8_mxu)  # noqa: E731
    return [tpu.TpuConfig()] + [cfg for cfg, _ in distinct_plans(first, near, plan_of, limit - 1)]


def even_sizes(m: int, e: int) -> jax.Array:
    """``m`` rows spread over ``e`` groups as evenly as they go (the first ``m % e`` get one
    more)."""
    return (m // e + (jnp.arange(e) < m % e)).astype(jnp.int32)


def tuned_config(x, w_q, group_sizes_E, *, out_dtype, run) -> mgpu.MgpuConfig | None:
    """The tuned config for ``grouped_fp8_matmul`` at this call's shapes on the target (an
    ``MgpuConfig`` on a Hopper GPU, a ``TpuConfig`` on a TPU; ``run``: the op itself, called
    with ``impl`` and ``config``), or None (nothing ran: the default)."""
    ws = stacks(w_q)
    (m, k), e = x.shape, ws[0].shape[0]
    ns = tuple(w.shape[1] for w in ws)
    out_dtype = jnp.dtype(out_dtype)
    dev = target_device()
    on_tpu = dev.platform == "tpu"
    if on_tpu:
        fp8_mxu = has_fp8_mxu(dev.device_kind)
        cands = tpu_candidates(m, k, ns, e, fp8_mxu)

        def name_of(cfg):
            return plan_name(tpu.plan(m, k, ns, e, cfg, fp8_mxu=fp8_mxu))
    else:
        cands, name_of = candidates(m, k, ns, e, out_dtype.itemsize), name
    impl = "pallas_tpu" if on_tpu else "pallas_mosaic_gpu"
    made = []

    def operands():  # random operands of the call's shapes, built only if something is timed
        if not made:
            keys = jax.random.split(jax.random.key(0), len(ws) + 1)
            xv = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
            if isinstance(x, QArray):
                xv = QArray(xv.astype(x.values.dtype), jnp.ones(x.scales.shape, jnp.float32),
                            x.block_shape, x.dtype)  # fmt: skip
            else:
                xv = xv.astype(x.dtype)
            wr = tuple(
                QArray(autotune.random_like(kk, w.shape, w.values.dtype),
                       jnp.ones(w.scales.shape, jnp.float32), w.block_shape, w.dtype)
                for kk, w in zip(keys[1:], ws, strict=True)
            )  # fmt: skip
            made.extend([xv, wr if isinstance(w_q, tuple) else wr[0], even_sizes(m, e)])
        return made

    def run_with(cfg):
        fn = jax.jit(lambda x_, w_, g_: run(x_, w_, g_, impl=impl, config=cfg,
                                            out_dtype=out_dtype))  # fmt: skip
        return lambda: jax.block_until_ready(fn(*operands()))

    x_kind = str(x.values.dtype if isinstance(x, QArray) else x.dtype)
    shape = (m, k, *ns, e, x_kind, str(ws[0].values.dtype), str(out_dtype))
    del group_sizes_E  # traced: the tiles are tuned for the shapes, the routing spread evenly
    return attention_autotune.tuned(OP, shape, cands, run_with, name_of=name_of, impl=impl)
