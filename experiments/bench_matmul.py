"""Benchmark blockwise FP8 ``fp8_matmul`` against BF16 ``jnp.dot`` in the same run.

Method (docs/../shared/reference/performance_anchors.md §3): warm up until compiled, then time
>= 20 calls one by one (wall clock of the jitted call, ``block_until_ready``), report the median
and p20/p80, TFLOP/s = 2MNK / t and the speedup vs BF16. On GPU the L2 is flushed (256 MB write)
before each timed call. Data: x ~ N(0, 1) in BF16, w ~ N(0, 1) / sqrt(K) in BF16, quantized with
real amax scales (1x128 activation groups, 128x128 weight blocks, E4M3).

Rows per shape: ``bf16`` (jnp.dot, f32 accumulation, BF16 out), ``<impl>`` (pre-quantized x: GEMM
only) and ``<impl>+quant`` (raw BF16 x: includes activation quantization, the vLLM op definition;
fused in-kernel for ``pallas_mosaic_gpu``), and on GPU ``te_fp8_tensor`` (Transformer Engine
per-tensor current-scaling FP8 GEMM) when ``transformer_engine.jax`` imports. On CPU the FP8 path
is the jnp reference (``xla``), an emulation that dequantizes: its "speedup" is not an FP8 result.
On GPU ``xla`` is the XLA fast path (FP8 GEMMs batched over K blocks for M <= 32, BF16 dequantize
+ BF16 GEMM above: ``kernels_pallas/fp8_matmul/xla.py``), the fallback ``auto`` uses.

Usage: ``python experiments/bench_matmul.py --quick`` (CPU, ~30 s); on a GPU without flags.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.fp8_matmul import default_impl, fp8_matmul
from kernels_pallas.quantize import quantize_activations, quantize_weight

DECODE_M = (1, 16, 64, 128)
LARGE_M = 4096
NK_GPU = ((7168, 16384), (24576, 7168), (2112, 7168), (4096, 7168))  # DeepSeek-V3 layers (N, K)
DISTRIBUTION = "x ~ N(0,1) bf16; w ~ N(0,1)/sqrt(K) bf16; E4M3, 1x128 / 128x128 amax scales"


def _shapes(platform: str, quick: bool) -> list[tuple[int, int, int]]:
    if platform == "cpu":
        ms, nks = (1, 16, 128), ((512, 512), (1024, 1024))
        if not quick:
            ms, nks = (1, 16, 64, 128, 512), nks + ((2048, 2048),)
        return [(m, n, k) for n, k in nks for m in ms]
    decode = [(m, n, k) for n, k in NK_GPU for m in DECODE_M]
    return decode + [(LARGE_M, n, k) for n, k in NK_GPU]


def _impls() -> list[str]:
    impls = ["xla"]
    if default_impl() != "xla":
        impls.append(default_impl())
    return impls


def _time(fn, args, n_runs: int, flush) -> np.ndarray:
    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))  # warm
    times = []
    for _ in range(n_runs):
        if flush is not None:
            flush()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return np.asarray(times)


def _make_flush(platform: str):
    if platform != "gpu":
        return None
    buf = jnp.zeros((64 * 2**20,), jnp.float32)  # 256 MB >= 2x the H100/H200 L2 (50 MB)
    step = jax.jit(lambda b: b + 1.0, donate_argnums=0)

    def flush():
        nonlocal buf
        buf = step(buf)
        buf.block_until_ready()

    return flush


def _te_fn(n: int):
    """Transformer Engine per-tensor FP8 (current scaling) dense, or None when unavailable."""
    try:
        import transformer_engine.jax as te
        from transformer_engine.common.recipe import Float8CurrentScaling
        from transformer_engine.jax.flax import DenseGeneral
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        return None, f"transformer_engine.jax unavailable: {type(e).__name__}: {e}"
    autocast = getattr(te, "autocast", None) or te.fp8_autocast
    layer = DenseGeneral(features=n, use_bias=False, dtype=jnp.bfloat16)

    def run(params, x):
        with autocast(enabled=True, recipe=Float8CurrentScaling()):
            return layer.apply(params, x)

    def init(x):
        with autocast(enabled=True, recipe=Float8CurrentScaling()):
            return layer.init(jax.random.key(0), x)

    return (init, jax.jit(run)), None


def bench_shape(m, n, k, impls, n_runs, flush, platform, te_ok):
    kx, kw = jax.random.split(jax.random.key(m * 131 + n * 7 + k))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    xq, wq = quantize_activations(x), quantize_weight(w)  # w [K, N] -> QArray [N, K]
    bf16 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
    rows = [("bf16", _time(bf16, (x, w), n_runs, flush))]
    for impl in impls:
        f = jax.jit(functools.partial(fp8_matmul, out_dtype=jnp.bfloat16, impl=impl))
        label = f"{impl} (emulated)" if platform == "cpu" else impl
        rows.append((label, _time(f, (xq, wq), n_runs, flush)))
        rows.append((f"{label}+quant", _time(f, (x, wq), n_runs, flush)))
    if te_ok is not None:
        init, run = te_ok
        params = init(x)
        rows.append(("te_fp8_tensor", _time(run, (params, x), n_runs, flush)))
    t_bf16 = np.median(rows[0][1])
    out = []
    for name, t in rows:
        med = float(np.median(t))
        out.append(
            dict(
                impl=name, m=m, n=n, k=k,
                median_us=med * 1e6,
                p20_us=float(np.percentile(t, 20)) * 1e6,
                p80_us=float(np.percentile(t, 80)) * 1e6,
                tflops=2 * m * n * k / med / 1e12,
                speedup_vs_bf16=float(t_bf16 / med),
            )
        )  # fmt: skip
    return out


def _jaxlib_version() -> str:
    import jaxlib

    return getattr(jaxlib, "__version__", "unknown")


def _git_sha() -> str:
    try:
        root = pathlib.Path(__file__).resolve().parents[1]
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root, text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, fewer runs (CPU ~30 s)")
    ap.add_argument("--runs", type=int, default=20, help="timed runs per row (>= 20)")
    ap.add_argument("--out", default=None, help="JSON path (default results/bench_matmul_<dev>)")
    args = ap.parse_args()
    dev = jax.devices()[0]
    platform = dev.platform
    impls = _impls()
    te_note = "not attempted off GPU"
    flush = _make_flush(platform)
    results = []
    print(f"device={dev.device_kind} jax={jax.__version__} impls={impls}")
    print(f"{'M':>5} {'N':>6} {'K':>6} {'impl':<28} {'median us':>10} {'p20':>9} {'p80':>9} "
          f"{'TFLOP/s':>8} {'x bf16':>7}")  # fmt: skip
    for m, n, k in _shapes(platform, args.quick):
        te_pair = None
        if platform == "gpu":
            te_pair, te_note = _te_fn(n)
        for r in bench_shape(m, n, k, impls, max(args.runs, 20), flush, platform, te_pair):
            results.append(r)
            print(f"{m:>5} {n:>6} {k:>6} {r['impl']:<28} {r['median_us']:>10.1f} "
                  f"{r['p20_us']:>9.1f} {r['p80_us']:>9.1f} {r['tflops']:>8.3f} "
                  f"{r['speedup_vs_bf16']:>7.2f}")  # fmt: skip
    name = dev.device_kind.replace(" ", "_").lower() if platform != "cpu" else "cpu"
    path = pathlib.Path(
        args.out or pathlib.Path(__file__).parent / f"results/bench_matmul_{name}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        git_sha=_git_sha(),
        jax_version=jax.__version__,
        jaxlib_version=_jaxlib_version(),
        device_kind=dev.device_kind,
        platform=platform,
        n_devices=jax.device_count(),
        distribution=DISTRIBUTION,
        timing="wall clock of the jitted call; median, p20, p80 over runs after 2 warm-up calls",
        l2_flush=flush is not None,
        runs=max(args.runs, 20),
        quick=args.quick,
        transformer_engine=te_note,
        shapes=[list(s) for s in _shapes(platform, args.quick)],
    )
    path.write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
