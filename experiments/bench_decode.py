"""Benchmark decode attention: achieved HBM bandwidth of the kernel on FP8 and BF16 KV caches.

Rows per shape (B rows, S cache slots, H query heads over K KV heads, head_dim C = 128) and cache
kind (``fp8_static``: E4M3 with a per-KV-head scale; ``fp8_dynamic``: E4M3 with a scale per
cached vector [B, K, S]; ``bf16``): the target's kernel (``pallas_mosaic_gpu`` on Hopper) and,
as the baseline in the same run, the XLA reference (``impl="xla"``: dequantizes the whole
allocation to f32), each for two length patterns: ``full`` (every slot live) and ``ragged``
(lengths uniform in [S/8, S], starts in [0, 64): left padding). The same compiled program runs
both patterns (lengths are arguments). Where the Hopper kernel runs, ``pallas_mosaic_gpu:unswapped``
(``DecodeBlocks(swap_ab=False)``: the query group padded to a 64-row wgmma M tile) is timed
beside the default swap-AB kernel, and on FP8 caches ``pallas_mosaic_gpu:bs128`` (``DecodeBlocks(
block_s=128)``: 128-slot tiles, one CTA per SM, the attention autotuner's wide candidate) and
``pallas_mosaic_gpu:st3`` (``DecodeBlocks(num_stages=3)``: the 3-stage ring the FP8 default was
until the first device run's latency said 5, its before in the same run). Each Hopper row
records its ring depth (``num_stages``).

Bytes = the live KV the op must read (``Σ_b (length_b - start_b) · K · C · 2 · itemsize``, plus
the dynamic scales) + q and o (BF16): issue 11's definition. GB/s = bytes / time (CUPTI kernel
time on GPU, else the wall clock; ``bench_common``), reported against the datasheet HBM peak
(``hbm_frac``; issue 11's target: >= 0.70 on an FP8 cache) and against a device-to-device copy
measured in this run (``copy_frac``). ``max_err``: max |out - reference| / max |reference| (the
reference's own row: 0). Data: q ~ N(0, 1), K ~ 2 N(0, 1), V ~ U(-1, 1), quantized with amax
scales (per KV head, or per cached vector).

Usage: ``python experiments/bench_decode.py --quick`` (CPU, tiny shapes, a few seconds; FP8 is
emulated there and the numbers say nothing about a GPU); on a GPU without flags (~40 s on an
H200); ``--interpret`` adds the Hopper kernel in interpret mode on CPU; ``--out PATH.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import bench_common as bc  # noqa: E402
from kernels_pallas import dependent_launch  # noqa: E402
from kernels_pallas.backend import default_impl, prepare_gpu_interpret  # noqa: E402
from kernels_pallas.decode_attention import DecodeBlocks, decode_attention  # noqa: E402

GPU_SHAPES = (  # (model, B, S, H, K)
    ("Qwen3-8B", 32, 8192, 32, 8),
    ("Qwen3-1.7B", 64, 4096, 16, 8),
    ("Llama-3-70B", 16, 16384, 64, 8),
)
GPU_HEAD_DIM = 128
CPU_SHAPES = (("tiny", 2, 256, 4, 2),)
CPU_HEAD_DIM = 64  # the Hopper kernel takes 64 or 128 (interpret mode is cheaper at 64)
CACHES = ("fp8_static", "fp8_dynamic", "bf16")
BASELINE_CACHES = ("fp8_static", "bf16")  # the XLA reference runs on these
F8 = jnp.float8_e4m3fn
DISTRIBUTION = "q ~ N(0,1) bf16; K ~ 2 N(0,1), V ~ U(-1,1); E4M3 with amax scales"
_H100 = jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132
)


def _quantize(x_BSKC, per_slot: bool):
    """E4M3 values and amax scales: per KV head [K], or per cached vector [B, K, S]."""
    amax = jnp.max(jnp.abs(x_BSKC), axis=3 if per_slot else (0, 1, 3))  # [B, S, K] or [K]
    scale = jnp.maximum(amax, 1e-12) / 448.0
    vals = jnp.clip(x_BSKC / scale[..., None], -448.0, 448.0).astype(F8)
    return vals, (jnp.swapaxes(scale, 1, 2) if per_slot else scale).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("b", "s", "h", "k", "c", "cache"))
def _operands(key, *, b, s, h, k, c, cache):
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, h, c), jnp.bfloat16)
    kc = 2.0 * jax.random.normal(kk, (b, s, k, c), jnp.float32)
    vc = jax.random.uniform(kv, (b, s, k, c), jnp.float32, -1.0, 1.0)
    if cache == "bf16":
        return dict(q=q, k=kc.astype(jnp.bfloat16), v=vc.astype(jnp.bfloat16))
    (kq8, ks), (vq8, vs) = (_quantize(x, cache == "fp8_dynamic") for x in (kc, vc))
    return dict(q=q, k=kq8, v=vq8, k_scale=ks, v_scale=vs)


def _lengths(b: int, s: int, pattern: str, seed: int):
    """(starts_B, lengths_B) int32 host arrays for a length pattern."""
    if pattern == "full":
        return np.zeros(b, np.int32), np.full(b, s, np.int32)
    r = np.random.default_rng(seed)
    lengths = r.integers(max(1, s // 8), s + 1, b).astype(np.int32)
    return np.minimum(r.integers(0, 64, b), lengths - 1).astype(np.int32), lengths


def _live_bytes(starts, lengths, h, k, c, cache) -> int:
    live = int(np.sum(lengths - starts))
    item = 2 if cache == "bf16" else 1
    kv = live * k * c * 2 * item + (live * k * 2 * 4 if cache == "fp8_dynamic" else 0)
    return kv + 2 * len(lengths) * h * c * 2  # + q and o in BF16


UNSWAPPED = ":unswapped"  # impl suffix: the Hopper kernel with DecodeBlocks(swap_ab=False)
WIDE = ":bs128"  # impl suffix: swap-AB over 128-slot tiles (the autotuner's wide FP8 candidate)
SHALLOW = ":st3"  # impl suffix: a 3-stage K/V ring (the FP8 default before the 5-stage one)
_SUFFIXES = {UNSWAPPED: DecodeBlocks(swap_ab=False), WIDE: DecodeBlocks(block_s=128),
             SHALLOW: DecodeBlocks(num_stages=3)}  # fmt: skip


def _config(impl: str) -> DecodeBlocks | None:
    return next((cfg for sfx, cfg in _SUFFIXES.items() if impl.endswith(sfx)), None)


def ring_depth(impl: str, cache: str, b: int, s: int, k: int, c: int) -> int | None:
    """The K/V ring depth a Hopper arm runs at (its config resolved as the kernel does); None
    for the XLA reference."""
    if not impl.startswith("pallas_mosaic_gpu"):
        return None
    from kernels_pallas.decode_attention import pallas_mosaic_gpu as mgpu

    dtype = jnp.bfloat16 if cache == "bf16" else jnp.float8_e4m3fn
    k_sds = jax.ShapeDtypeStruct((b, s, k, c), dtype)
    return mgpu.resolve_blocks(_config(impl), None, k_sds).num_stages


def _attend(sets, starts, lengths, *, impl, c, interpret):
    config = _config(impl)
    impl = impl.split(":")[0]
    return [
        decode_attention(
            st["q"],
            st["k"],
            st["v"],
            lengths,
            starts_B=starts,
            k_scale=st.get("k_scale"),
            v_scale=st.get("v_scale"),
            sm_scale=c**-0.5,
            impl=impl,
            config=config,
            interpret=interpret,
        )  # fmt: skip
        for st in sets
    ]


def copy_bandwidth(runs: int) -> float:
    """Bytes/s of ``y = 2 x`` (read + write) over 2 GiB on GPU, 64 MiB elsewhere."""
    on_gpu = jax.devices()[0].platform == "gpu"
    x = jnp.ones(((2**30 if on_gpu else 2**25),), jnp.bfloat16)
    compiled, cs = bc.compile_fn(lambda a: a * 2, x)
    t = bc.time_compiled(compiled, (x,), runs=runs, compile_s=cs)
    return 2 * x.size * 2 / float(np.median(t.best))


def _timed_impls(cache: str, impls: list[str]) -> list[str]:
    """The impls timed on a cache kind: the XLA reference only on ``BASELINE_CACHES``, unless it
    is the only impl (CPU); the 128-slot tiles and the 3-stage ring on FP8 caches only."""
    keep = [i for i in impls if i != "xla" or cache in BASELINE_CACHES or impls == ["xla"]]
    return [i for i in keep if not (i.endswith((WIDE, SHALLOW)) and cache == "bf16")]


def bench_shape(model, b, s, h, k, c, impls, runs, interpret, pk, copy_bw) -> list[dict]:
    """Every cache kind x impl x length pattern at one shape."""
    platform = jax.devices()[0].platform
    patterns = {
        p: tuple(map(jnp.asarray, _lengths(b, s, p, seed=b + s))) for p in ("full", "ragged")
    }
    rows = []
    for cache in CACHES:
        item = 2 if cache == "bf16" else 1
        reps = bc.rotations(2 * b * s * k * c * item, platform)
        sets = [
            _operands(jax.random.key(7 * i + s + b), b=b, s=s, h=h, k=k, c=c, cache=cache)
            for i in range(reps)
        ]
        programs, refs = {}, {}
        for impl in ["xla", *(i for i in _timed_impls(cache, impls) if i != "xla")]:
            fn = functools.partial(_attend, impl=impl, c=c, interpret=interpret)
            try:
                programs[impl] = bc.compile_fn(fn, sets, *patterns["full"])
            except Exception as e:  # noqa: BLE001 - one failed arm must not end the run
                rows.append(dict(model=model, b=b, s=s, h=h, k=k, c=c, cache=cache, impl=impl,
                                 error=f"{type(e).__name__}: {str(e)[:500]}"))  # fmt: skip
        if "xla" in programs:  # the reference outputs, for max_err
            refs = {p: programs["xla"][0](sets, *ln)[0].astype(jnp.float32)
                    for p, ln in patterns.items()}  # fmt: skip
        for impl in _timed_impls(cache, impls):
            if impl not in programs:
                continue
            compiled, compile_s = programs[impl]
            for pattern, (starts, lengths) in patterns.items():
                args = (sets, starts, lengths)
                t = bc.time_compiled(compiled, args, runs=runs, reps=reps, compile_s=compile_s)
                nbytes = _live_bytes(np.asarray(starts), np.asarray(lengths), h, k, c, cache)
                gbps = nbytes / float(np.median(t.best)) / 1e9
                err = None
                if refs:
                    ref, out = refs[pattern], compiled(*args)[0].astype(jnp.float32)
                    err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
                rows.append(dict(model=model, b=b, s=s, h=h, k=k, c=c, cache=cache, impl=impl,
                                 lengths=pattern) | t.summary() | dict(
                    live_tokens=int(np.sum(np.asarray(lengths) - np.asarray(starts))),
                    bytes=nbytes, gbps=gbps, copy_frac=gbps * 1e9 / copy_bw, max_err=err,
                    hbm_frac=gbps * 1e9 / pk.hbm_bytes_s if pk.hbm_bytes_s else None,
                    num_stages=ring_depth(impl, cache, b, s, k, c),
                    # the Hopper kernels launch dependent unless FP8RL_PDL=0 (the model's launch)
                    pdl=impl.startswith("pallas_mosaic_gpu") and dependent_launch.enabled(),
                ))  # fmt: skip
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    head = ["model", "B", "S", "H/K", "cache", "impl", "lengths", "median us", "GB/s",
            "of HBM peak", "of copy", "max err", "timer"]  # fmt: skip
    body = [
        [r["model"], r["b"], r["s"], f"{r['h']}/{r['k']}", r["cache"], r["impl"],
         r.get("lengths"), r.get("median_us"), r.get("gbps"), r.get("hbm_frac"),
         r.get("copy_frac"), r.get("max_err"), r.get("timer", r.get("error"))]
        for r in rows
    ]  # fmt: skip
    bw = meta["copy_bandwidth_gbps"]
    peak = meta["peaks"]["hbm_bytes_s"]
    peak = f"{peak / 1e9:.0f} GB/s" if peak else "unknown"
    title = (
        f"## decode attention ({meta['device_kind']}, jax {meta['jax']}; "
        f"copy {bw:.0f} GB/s, HBM peak {peak})\n\n"
    )
    return title + bc.md_table(head, body)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU: a tiny shape, 5 runs")
    ap.add_argument("--runs", type=int, default=None, help="timed calls per row (GPU 20, CPU 5)")
    ap.add_argument("--interpret", action="store_true", help="add the Hopper kernel, interpreted")
    ap.add_argument("--out", default=None, help="JSON path (default results/bench_decode_<dev>)")
    args = ap.parse_args(argv)
    if args.interpret:  # before the first computation (backend.GPU_INTERPRET_XLA_FLAG)
        prepare_gpu_interpret()
    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    shapes, c = (
        (GPU_SHAPES, GPU_HEAD_DIM) if on_gpu and not args.quick else (CPU_SHAPES, CPU_HEAD_DIM)
    )
    impls = list(dict.fromkeys([default_impl(), "xla"]))
    if args.interpret and "pallas_mosaic_gpu" not in impls:
        impls.insert(0, "pallas_mosaic_gpu")
    if "pallas_mosaic_gpu" in impls:  # the swap-AB kernel's before, timed in the same run,
        impls.insert(1, "pallas_mosaic_gpu" + UNSWAPPED)  # and on FP8 its 128-slot tiles and
        impls.insert(2, "pallas_mosaic_gpu" + WIDE)  # the 3-stage ring it had before
        impls.insert(3, "pallas_mosaic_gpu" + SHALLOW)
    runs = args.runs or (20 if on_gpu else 5)
    pk = bc.peaks(dev.device_kind)
    copy_bw = copy_bandwidth(runs)
    meta = bc.env_meta() | dict(
        bench="decode_attention", quick=args.quick, runs=runs, impls=impls, head_dim=c,
        interpret=args.interpret, distribution=DISTRIBUTION, peaks=vars(pk),
        copy_bandwidth_gbps=copy_bw / 1e9, bytes="live KV (+ dynamic scales) + q + o",
    )  # fmt: skip
    out = args.out or bc.default_out("bench_decode")
    ctx = jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((), (), abstract_device=_H100)
    ) if args.interpret else contextlib.nullcontext()  # fmt: skip
    print(f"device={dev.device_kind} jax={jax.__version__} impls={impls}")
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    rows = []
    for model, b, s, h, k in shapes:
        with ctx:
            new = bench_shape(model, b, s, h, k, c, impls, runs, args.interpret, pk, copy_bw)
        rows += new
        for r in new:
            print(f"{model:<12} B={b:<4} S={s:<6} {h}/{k} {r['cache']:<12} {r['impl']:<18} "
                  f"{r.get('lengths', ''):<7} {r.get('median_us', float('nan')):>9.1f} us "
                  f"{r.get('gbps', float('nan')):>8.1f} GB/s {r.get('error', '')}")  # fmt: skip
        bc.write_results(out, meta, rows, markdown(meta, rows))
    print(f"wrote {out}")
    return dict(meta=meta, rows=rows)


if __name__ == "__main__":
    main()
