"""On-device autotuning of the decode attention kernels' tiling (dense and paged; Hopper, TPU).

In a long-response rollout the decode attention is most of a step (the performance model:
~60% of the FP8 decode step of a Qwen3-8B rollout at a 4K context), and the first H200 run
measured the FP8-cache kernel at 58-68% of HBM against 83-91% for the BF16 one, at default
tilings chosen by rules written without a device (``resolve_blocks``, ``default_splits``: chunks
to fill one wave of 2 CTAs per SM, then 3 pipeline stages on an FP8 cache, swap-AB; the FP8
default is now 5 stages, which the performance model fitted to that run puts at the HBM bound).
With ``FP8RL_AUTOTUNE=1`` on a Hopper GPU, the first call of ``decode_attention`` or
``paged_attention`` with ``impl="auto"`` and no config at a shape times a few tilings around the
default and caches the fastest, as ``fp8_matmul`` does (``kernels_pallas.autotune``: the same
cache files, keyed by device kind, jax version, op and shape). Candidates (``blocks``): the
default; its chunk count halved, doubled and quadrupled (more CTAs in flight per SM); the other
pipeline depths (2-5); the other layout (the unswapped kernel, at its own default depth);
for the dense kernel, 128-slot tiles where the support check takes them (FP8 caches: query
groups up to 16), twice the bytes per serial tile step at one CTA per SM. Each
is timed on random operands of the call's shape, dtypes and scale kind with every slot live
(full rows: at trace time the lengths are not known), through the same output path
(``quant_out``). Splitting changes the order of the softmax's sums: outputs move by rounding.

On a real TPU the TPU kernels' tilings are timed the same way (``tpu_name``): the dense kernel's
tiles of 128 / 256 / 512 cache slots with one and two chunks per row, the paged kernel's 1, 2
and 4 chunks (a tile is one page); v5e / v6e have one TensorCore, so chunks buy parallelism only
where a chip has two, and the device decides.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas import autotune
from kernels_pallas.backend import target_device

OPS = ("decode_attention", "paged_attention")
# The paged tuner's pool (K and V each): 4x an H100's 50 MB L2, so that rows whose tables wrap
# around it find their pages evicted, as in the engine's pool; a cache-sized copy could not fit
# beside the program being traced.
TIMING_POOL_BYTES = 256 * 2**20


def split_choices(default: int, limit: int) -> list[int]:
    """The default chunk count first, then half, double and four times it, within [1, limit]."""
    out = [default, max(1, default // 2), 2 * default, 4 * default]
    return list(dict.fromkeys(min(max(1, s), limit) for s in out))


def blocks(default, limit: int, stages: tuple[int, ...], block_sizes: tuple[int, ...] = (),
           other_layout_stages: int | None = None) -> list:  # fmt: skip
    """Candidate configs around ``default`` (a resolved ``DecodeBlocks`` or ``PagedBlocks``: its
    ``num_splits``, ``num_stages`` and ``swap_ab`` set): the default first, then its chunk
    counts (``split_choices`` up to ``limit``), the other pipeline depths, the other
    ``swap_ab`` (at ``other_layout_stages``, that layout's default depth; None: the default's),
    then (dense only) the default at each other tile size of ``block_sizes``; no duplicates."""
    rep = dataclasses.replace
    out = [default]
    out += [rep(default, num_splits=j) for j in split_choices(default.num_splits, limit)]
    out += [rep(default, num_stages=st) for st in stages]
    out.append(rep(default, swap_ab=not default.swap_ab,
                   num_stages=other_layout_stages or default.num_stages))  # fmt: skip
    out += [rep(default, block_s=bs) for bs in block_sizes]
    return list(dict.fromkeys(out))


def name(cfg) -> str:
    bs = getattr(cfg, "block_s", None)
    tile = f"/bs{bs}" if bs not in (None, 64) else ""
    return f"J={cfg.num_splits}/st{cfg.num_stages}/{'swap' if cfg.swap_ab else 'unswapped'}{tile}"


def enabled_for(impl: str, config, interpret: bool, platform: str | None = None) -> bool:
    """Whether a call tunes its tiling: autotuning on, ``impl="auto"``, no config, a real
    Hopper GPU or a real TPU (not interpret mode, not a deviceless compile for one);
    ``platform``: only that one ("gpu" or "tpu"; None: either)."""
    if impl != "auto" or config is not None or interpret or not autotune.enabled():
        return False
    here = jax.devices()[0].platform
    if here not in ("gpu", "tpu") or platform not in (None, here):
        return False
    return here == "tpu" or target_device().is_hopper


def _operands(*shaped):
    """A function making random arrays shaped like ``shaped`` (arrays or ShapeDtypeStructs) on
    its first call and returning the same ones after: built only if a candidate is timed."""
    made = []

    def get():
        if not made:
            keys = jax.random.split(jax.random.key(0), len(shaped))
            made.extend(autotune.random_like(kk, a.shape, a.dtype)
                        for kk, a in zip(keys, shaped, strict=True))  # fmt: skip
        return made

    return get


def _scale_like(sc):
    return None if sc is None else jnp.ones(jnp.shape(sc), jnp.float32)


def tuned(op: str, shape: tuple, cands: list, run_with, name_of=name,
          impl: str = "pallas_mosaic_gpu") -> object | None:  # fmt: skip
    """The fastest of ``cands`` (configs, named by ``name_of``) at ``shape``, from the cache or
    timed now with ``run_with(cfg)`` (a zero-argument callable that runs the op once); None if
    none ran. Shared by the grouped FP8 kernel's tuner (``grouped_fp8_matmul.tuning``)."""
    dev = target_device()
    k = autotune.key(dev.device_kind, jax.__version__, op, shape)

    def candidates():
        return [autotune.Candidate(name_of(c), impl, c, run_with(c))
                for c in cands]  # fmt: skip

    try:  # the timer looked up now (tests inject one)
        record = autotune.lookup_or_tune(k, candidates, timer=autotune.device_timer)
    except RuntimeError:  # no candidate ran: the default path decides
        return None
    return {name_of(c): c for c in cands}.get(record["choice"])


def tpu_name(cfg) -> str:
    """A TPU attention candidate's name: its chunks and (dense) its tile of cache slots."""
    bs = getattr(cfg, "block_s", None)
    return f"tpu:J={cfg.num_splits}" + (f"/bs{bs}" if bs else "")


def _tpu_dense_candidates(q, k, v, lengths, kw) -> list:
    """The TPU kernel's tilings: its default, then every other tile of cache slots it takes
    (128, 256, 512 dividing S) with one and two chunks per row (v5e / v6e have one TensorCore;
    a chip with two may gain from two chunks), each its support check accepts."""
    from kernels_pallas.decode_attention import pallas_tpu as tpu
    from kernels_pallas.decode_attention.common import DecodeBlocks

    s = k.shape[1]
    default = tpu.resolve_blocks(None, q, k)
    cands = [default] + [DecodeBlocks(block_s=bs, num_splits=j)
                         for bs in tpu._BLOCK_S if s % bs == 0  # noqa: SLF001
                         for j in (1, 2) if j <= s // bs]  # fmt: skip
    ok = lambda cfg: tpu.supports(q, k, v, lengths, starts_B=None, k_scale=kw["k_scale"],
                                  v_scale=kw["v_scale"], sm_scale=kw["sm_scale"], config=cfg,
                                  interpret=False) is None  # noqa: E731  # fmt: skip
    return [c for c in dict.fromkeys(cands) if ok(c)]


def dense_config(q, k, v, *, k_scale, v_scale, sm_scale, quant_out, run):
    """The tuned ``DecodeBlocks`` for ``decode_attention`` at this call's shape (``run``: the
    op itself, called with ``impl`` and ``config``), or None. On a TPU, the TPU kernel's
    tilings (``_tpu_dense_candidates``). Times on a K/V pair of the cache's own shape (every
    row's slots live: the kernel's cost), made while tuning and freed after it: a first use
    needs that much memory free beside the traced program (the paged tuner bounds its pool:
    ``TIMING_POOL_BYTES``)."""
    from kernels_pallas.decode_attention import pallas_mosaic_gpu as mgpu

    b, s, n_kv, c = k.shape
    operands = _operands(q, k, v)
    lengths = jnp.full((b,), s, jnp.int32)
    kw = dict(k_scale=_scale_like(k_scale), v_scale=_scale_like(v_scale), sm_scale=sm_scale,
              quant_out=quant_out)  # fmt: skip
    if target_device().platform == "tpu":
        impl, name_of = "pallas_tpu", tpu_name
        cands = _tpu_dense_candidates(q, k, v, lengths, kw)
    else:
        impl, name_of = "pallas_mosaic_gpu", name
        default = mgpu.resolve_blocks(None, q, k)
        ok = lambda cfg: mgpu.supports(q, k, v, lengths, starts_B=None, k_scale=kw["k_scale"],
                                       v_scale=kw["v_scale"], sm_scale=sm_scale, config=cfg,
                                       interpret=False) is None  # noqa: E731  # fmt: skip
        # 128-slot tiles (twice the bytes per serial step, one CTA per SM) at the default chunks
        wide = tuple(bs for bs in mgpu.block_sizes(k.dtype, True, q.shape[1] // n_kv) if bs > 64)
        other = mgpu.default_stages(k.dtype, not default.swap_ab)
        limit = max(1, s // default.block_s)
        cands = [cfg for cfg in blocks(default, limit, mgpu._STAGES, wide, other)  # noqa: SLF001
                 if ok(cfg)]  # fmt: skip

    def run_with(cfg):
        fn = jax.jit(lambda q_, k_, v_: run(q_, k_, v_, lengths, impl=impl, config=cfg, **kw))
        return lambda: jax.block_until_ready(fn(*operands()))

    shape = (*q.shape, *k.shape, str(q.dtype), str(k.dtype), _scale_kind(k_scale), str(quant_out))
    return tuned("decode_attention", shape, cands, run_with, name_of=name_of, impl=impl)


def paged_config(q, k_pages, v_pages, table, *, k_scale, v_scale, sm_scale, quant_out, run):
    """The tuned ``PagedBlocks`` for ``paged_attention`` at this call's shape, or None (on a
    TPU: 1, 2 and 4 chunks per row, the TPU kernel's one tiling knob)."""
    from kernels_pallas.decode_attention import pallas_mosaic_gpu as dense
    from kernels_pallas.paged_attention import pallas_mosaic_gpu as mgpu
    from kernels_pallas.paged_attention.common import PagedBlocks

    b, w = table.shape
    x, y, n_kv, c = k_pages.shape
    # Timed on a pool of at most TIMING_POOL_BYTES: the pages each row reads are what the kernel
    # costs, not the pool's size, and the engine's pool (most of the memory left) has no twin.
    page_bytes = y * n_kv * c * jnp.dtype(k_pages.dtype).itemsize
    x_t = max(1, min(x, b * w, TIMING_POOL_BYTES // page_bytes))
    pool = jax.ShapeDtypeStruct((x_t, y, n_kv, c), k_pages.dtype)
    operands = _operands(q, pool, pool)
    table_r = (jnp.arange(b * w, dtype=jnp.int32) % x_t).reshape(b, w)  # rows' pages distinct
    lengths = jnp.full((b,), w * y, jnp.int32)

    def fit(sc):  # per-vector scales [X, K, Y] follow the pool
        if sc is not None and jnp.ndim(sc) == 3:
            return jnp.ones((x_t, *jnp.shape(sc)[1:]), jnp.float32)
        return _scale_like(sc)

    kw = dict(k_scale=fit(k_scale), v_scale=fit(v_scale), sm_scale=sm_scale, quant_out=quant_out)
    if target_device().platform == "tpu":  # one page a tile: the chunks per row alone
        impl, name_of = "pallas_tpu", tpu_name
        cands = [PagedBlocks(num_splits=j) for j in split_choices(1, w)]
    else:
        impl, name_of = "pallas_mosaic_gpu", name
        default = PagedBlocks(num_splits=mgpu.default_splits(b, w, n_kv),
                              num_stages=dense.default_stages(k_pages.dtype),
                              swap_ab=True)  # fmt: skip

        def ok(cfg):
            return mgpu.supports(q, pool, pool, lengths, table_r, k_scale=kw["k_scale"],
                                 v_scale=kw["v_scale"], sm_scale=sm_scale, config=cfg,
                                 interpret=False) is None  # fmt: skip

        other = dense.default_stages(k_pages.dtype, False)
        cands = [cfg for cfg in blocks(default, w, mgpu._STAGES, (), other)  # noqa: SLF001
                 if ok(cfg)]  # fmt: skip

    def run_with(cfg):
        fn = jax.jit(lambda q_, k_, v_: run(q_, k_, v_, lengths, table_r, impl=impl, config=cfg,
                                            **kw))  # fmt: skip
        return lambda: jax.block_until_ready(fn(*operands()))

    shape = (*q.shape, *k_pages.shape, w, str(q.dtype), str(k_pages.dtype),
             _scale_kind(k_scale), str(quant_out))  # fmt: skip
    return tuned("paged_attention", shape, cands, run_with, name_of=name_of, impl=impl)


def _scale_kind(sc) -> str:
    return "none" if sc is None else f"scale{jnp.ndim(sc)}d"
