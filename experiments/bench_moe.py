"""Benchmark the grouped FP8 GEMM of MoE experts against BF16 ``ragged_dot`` and the old path.

Arms, per expert layer and row count (rows = tokens · top-k, sorted by expert):
  * ``bf16_ragged_dot``: BF16 weights ``[E, K, N]``, ``jax.lax.ragged_dot`` (f32 accumulation);
    gate and up as two calls, as the BF16 MoE layer ran them before ``grouped_matmul``;
  * ``bf16_grouped:pallas_mosaic_gpu`` (Hopper): the same through ``grouped_matmul``'s kernel,
    as the BF16 MoE layer (scoring, training) runs them on Hopper now;
  * ``emulated_fp8``: the MoE layer's FP8 path before ``grouped_fp8_matmul`` (x quantized per
    token, both operands dequantized to f32, ``ragged_dot`` at HIGHEST precision), per stack;
  * ``grouped_fp8:<impl>``: ``grouped_fp8_matmul`` (FP8 x given: the GEMM alone; gate and up in
    one call over both stacks) for ``xla`` and, on GPU/TPU, the target's kernel;
  * ``grouped_fp8:<impl>+quant``: the same from BF16 x (includes the per-token quantization).

Reported: the median wall time of the jitted call (>= 20 runs after 2 warm-ups; on GPU the L2
is flushed before each), TFLOP/s over the useful FLOPs ``2·rows·N·K``, the error against float64
(relative Frobenius, against the product of the exactly dequantized operands and against the
unquantized BF16 operands), the operand bytes (weights + x + y), and XLA's cost analysis of the
compiled call (``flops``, ``bytes accessed``) where the backend gives one (CPU, GPU). ``--aot-h100``
also compiles every arm for H100 without a device (needs ``.aot/venv``) and counts the dot FLOPs
and HBM bytes of the optimized HLO: that is where XLA:GPU's ``ragged_dot`` shows its E-fold
dense expansion (openxla/xla#45996) and the row-tile path shows it has none. (A Pallas kernel's
HBM bytes count every operand in full, all E experts' weights: an upper bound, since the kernel
reads only the experts that have rows.) On GPU the two ``ragged_dot`` baselines are skipped where
their expanded operand ``[rows, E·K]`` would exceed ``MAX_EXPANSION_BYTES`` (prefill).

Data: x ~ N(0, 1) BF16; w ~ N(0, 1)/sqrt(K) BF16, quantized with amax scales (1x128, 128x128,
E4M3); each token picks top-k distinct experts uniformly at random (seeded). Shapes: Qwen3-30B-A3B
experts (E=128, top-8, D=2048, F=768) on GPU/TPU; on CPU a scaled copy (E=32, top-4, D=512,
F=256) unless ``--full``.

  .venv/bin/python experiments/bench_moe.py --quick           # CPU, ~2 min
  .aot/venv/bin/python experiments/bench_moe.py --quick --aot-h100
  python experiments/bench_moe.py                              # on a GPU: Qwen3-30B-A3B shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """Expert widths of one MoE model."""

    name: str
    experts: int  # E
    top_k: int  # k
    d: int  # model dim D
    f: int  # expert ffw dim F


QWEN3_30B_A3B = MoeShape("Qwen3-30B-A3B", 128, 8, 2048, 768)
CPU_SCALED = MoeShape("Qwen3-30B-A3B/4 (CPU)", 32, 4, 512, 256)
DECODE_TOKENS = (1, 8, 64, 256)  # sequences per decode step
PREFILL_TOKENS = (512, 8192)
CPU_TOKENS = (1, 16, 128, 1024)
CPU_QUICK_TOKENS = (1, 64, 512)
MAX_EXPANSION_BYTES = 16 * 2**30  # GPU: skip ragged_dot baselines whose expansion exceeds this
DISTRIBUTION = (
    "x ~ N(0,1) bf16; w ~ N(0,1)/sqrt(K) bf16; E4M3, 1x128 / 128x128 amax scales; "
    "top-k distinct experts per token uniformly at random"
)


def _layers(s: MoeShape):
    """(layer, K, N of each stack)."""
    return (("gate+up", s.d, (s.f, s.f)), ("down", s.f, (s.d,)))


def _routing(tokens: int, s: MoeShape, seed: int):
    """Group sizes [E] of ``tokens · k`` rows sorted by expert (distinct experts per token)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens, s.experts)), axis=1)[:, : s.top_k]
    return np.bincount(ids.reshape(-1), minlength=s.experts).astype(np.int32)


def make_operands(tokens: int, k: int, ns: tuple[int, ...], s: MoeShape, seed: int = 0):
    """BF16 x [rows, K], BF16 stacks [E, K, N_i], their QArrays [E, N_i, K], group sizes."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.quantize import quantize_activations, quantize_weight

    rows = tokens * s.top_k
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (rows, k), jnp.bfloat16)
    ws = [
        (
            jax.random.normal(jax.random.fold_in(kw, i), (s.experts, k, n), jnp.float32) / k**0.5
        ).astype(jnp.bfloat16)
        for i, n in enumerate(ns)
    ]
    gs = jnp.asarray(_routing(tokens, s, seed))
    return x, ws, quantize_activations(x), tuple(quantize_weight(w) for w in ws), gs


def _bf16_ragged(x, ws, gs):
    import jax
    import jax.numpy as jnp

    ys = [jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32) for w in ws]
    return jnp.concatenate(ys, axis=-1).astype(jnp.bfloat16)


def _bf16_grouped(x, ws, gs):
    """The BF16 experts as training runs them on Hopper: ``grouped_matmul``'s kernel."""
    import jax.numpy as jnp

    from kernels_pallas.grouped_matmul import grouped_matmul

    ys = [grouped_matmul(x, w, gs, impl="pallas_mosaic_gpu") for w in ws]
    return jnp.concatenate(ys, axis=-1)


def _emulated(x, ws_q, gs):
    """The MoE layer's FP8 experts before ``grouped_fp8_matmul`` (dequantize, f32 ragged_dot)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.qarray import dequantize, dequantize_weight
    from kernels_pallas.quantize import quantize_activations

    xd = dequantize(quantize_activations(x, 128, ws_q[0].values.dtype), jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    ys = [
        jax.lax.ragged_dot(
            xd,
            dequantize_weight(w, jnp.float32),
            gs,
            precision=hi,
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        for w in ws_q
    ]
    return jnp.concatenate(ys, axis=-1).astype(jnp.bfloat16)


def _grouped(x, ws_q, gs, impl):
    from kernels_pallas.grouped_fp8_matmul import grouped_fp8_matmul

    w = ws_q if len(ws_q) > 1 else ws_q[0]
    return grouped_fp8_matmul(x, w, gs, impl=impl)


def arms(impls):
    """name -> (fn, which x it takes: "bf16" | "fp8", which weights: "bf16" | "fp8")."""
    out = {
        "bf16_ragged_dot": (_bf16_ragged, "bf16", "bf16"),
        "emulated_fp8": (_emulated, "bf16", "fp8"),
    }
    if "pallas_mosaic_gpu" in impls:
        out["bf16_grouped:pallas_mosaic_gpu"] = (_bf16_grouped, "bf16", "bf16")
    for impl in impls:
        out[f"grouped_fp8:{impl}"] = (functools.partial(_grouped, impl=impl), "fp8", "fp8")
        out[f"grouped_fp8:{impl}+quant"] = (functools.partial(_grouped, impl=impl), "bf16", "fp8")
    return out


def _args(kind_x, kind_w, ops):
    x, ws, xq, wsq, gs = ops
    return (x if kind_x == "bf16" else xq, ws if kind_w == "bf16" else wsq, gs)


def _rel_fro(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def float64_references(ops):
    """(y from the exactly dequantized FP8 operands, y from the BF16 operands), float64."""
    import numpy as np

    from kernels_pallas.qarray import dequantize

    x, ws, xq, wsq, gs = ops
    xd, x16 = np.asarray(dequantize(xq), np.float64), np.asarray(x, np.float64)
    wd = np.concatenate([np.asarray(dequantize(w), np.float64) for w in wsq], axis=1)  # [E,N,K]
    w16 = np.concatenate([np.asarray(w, np.float64) for w in ws], axis=2)  # [E, K, N]
    yq, y16 = np.zeros((x.shape[0], wd.shape[1])), np.zeros((x.shape[0], wd.shape[1]))
    start = 0
    for e, size in enumerate(np.asarray(gs)):
        rows = slice(start, start + size)
        yq[rows], y16[rows] = xd[rows] @ wd[e].T, x16[rows] @ w16[e]
        start += size
    return yq, y16


def _nbytes(tree) -> int:
    import jax

    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def _cost(compiled) -> dict:
    try:
        ca = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends have none
        return {}
    ca = ca[0] if isinstance(ca, list | tuple) else ca
    if not ca:
        return {}
    return {"xla_flops": ca.get("flops"), "xla_bytes_accessed": ca.get("bytes accessed")}


def _time(fn, args, n_runs: int, flush):
    import jax
    import numpy as np

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n_runs):
        if flush is not None:
            flush()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return np.asarray(times)


def _make_flush(platform: str):
    import jax
    import jax.numpy as jnp

    if platform != "gpu":
        return None
    buf = jnp.zeros((64 * 2**20,), jnp.float32)  # 256 MB >= 2x the H100/H200 L2 (50 MB)
    step = jax.jit(lambda b: b + 1.0, donate_argnums=0)

    def flush():
        nonlocal buf
        buf = step(buf)
        buf.block_until_ready()

    return flush


def _expansion_bytes(name: str, rows: int, k: int, s: MoeShape) -> int:
    """Bytes of the zero-padded operand ``[rows, E·K]`` XLA:GPU builds for ``ragged_dot``."""
    itemsize = {"bf16_ragged_dot": 2, "emulated_fp8": 4}.get(name, 0)
    return rows * s.experts * k * itemsize


def bench_case(s, layer, k, ns, tokens, impls, n_runs, flush, platform) -> list[dict]:
    """Every arm on one (layer, row count): time, error, bytes, cost analysis."""
    import jax
    import numpy as np

    ops = make_operands(tokens, k, ns, s, seed=tokens)
    yq64, y16_64 = float64_references(ops)
    rows, n = tokens * s.top_k, sum(ns)
    flops = 2 * rows * n * k
    out = []
    for name, (fn, kind_x, kind_w) in arms(impls).items():
        if platform == "gpu" and _expansion_bytes(name, rows, k, s) > MAX_EXPANSION_BYTES:
            why = f"skipped: ragged_dot would expand to {_expansion_bytes(name, rows, k, s)} B"
            out.append(dict(model=s.name, layer=layer, k=k, n=n, tokens=tokens, rows=rows,
                            arm=name, skipped=why))  # fmt: skip
            continue
        args = _args(kind_x, kind_w, ops)
        jitted = jax.jit(fn)
        t = _time(jitted, args, n_runs, flush)
        y = np.asarray(jitted(*args), np.float64)
        med = float(np.median(t))
        out.append(dict(
            model=s.name, layer=layer, k=k, n=n, experts=s.experts, tokens=tokens, rows=rows,
            arm=name, median_us=med * 1e6, p20_us=float(np.percentile(t, 20)) * 1e6,
            p80_us=float(np.percentile(t, 80)) * 1e6, tflops=flops / med / 1e12,
            rel_err_vs_fp8_float64=_rel_fro(y, yq64), rel_err_vs_bf16_float64=_rel_fro(y, y16_64),
            operand_bytes=_nbytes(args) + rows * n * 2,
            **_cost(jitted.lower(*args).compile()),
        ))  # fmt: skip
    return out


def aot_h100_case(s, layer, k, ns, tokens) -> list[dict]:
    """Every arm compiled for H100 without a device: dot FLOPs and HBM bytes of its HLO."""
    import jax

    from experiments import hlo_flops
    from kernels_pallas import aot

    ops = jax.eval_shape(lambda: make_operands(tokens, k, ns, s))
    rows, n = tokens * s.top_k, sum(ns)
    useful = 2 * rows * n * k
    out = []
    for name, (fn, kind_x, kind_w) in arms(["xla", "pallas_mosaic_gpu"]).items():
        gs = jax.ShapeDtypeStruct((s.experts,), jax.numpy.int32)
        args = (*_args(kind_x, kind_w, ops)[:2], gs)
        res = aot.compile_for("h100", fn, *args)
        text = res.compiled.as_text()
        fl, hbm = hlo_flops.dot_flops(text), hlo_flops.hbm_bytes(text)
        out.append(dict(
            model=s.name, layer=layer, k=k, n=n, tokens=tokens, rows=rows, arm=name,
            hlo_dot_flops=fl, flops_over_useful=fl / useful, hlo_hbm_bytes=hbm,
            pallas_kernels=res.num_pallas_kernels,
        ))  # fmt: skip
    return out


def _git_sha() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO, text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def _print_rows(rows: list[dict], keys: list[str]) -> None:
    print(" ".join(f"{k:>14}" for k in keys))
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k)
            cells.append(f"{v:>14.4g}" if isinstance(v, float) else f"{v!s:>14}")
        print(" ".join(cells))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer row counts (CPU ~2 min)")
    ap.add_argument("--full", action="store_true", help="Qwen3-30B-A3B shapes on CPU too")
    ap.add_argument("--runs", type=int, default=20, help="timed runs per arm (>= 20)")
    ap.add_argument("--aot-h100", action="store_true", help="also count H100 HLO FLOPs/bytes")
    ap.add_argument("--out", default=None, help="JSON path (default results/bench_moe_<dev>)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.aot_h100:
        from kernels_pallas import aot

        aot.prepare_environment()
    import jax

    from kernels_pallas.backend import default_impl

    dev = jax.devices()[0]
    platform = dev.platform
    full = platform != "cpu" or args.full
    s = QWEN3_30B_A3B if full else CPU_SCALED
    tokens = DECODE_TOKENS + PREFILL_TOKENS if full else CPU_TOKENS
    tokens = CPU_QUICK_TOKENS if args.quick and not full else tokens
    impls = ["xla"] + ([default_impl()] if default_impl() != "xla" else [])
    flush, results, aot_rows = _make_flush(platform), [], []
    print(f"device={dev.device_kind} jax={jax.__version__} shape={s} impls={impls}")
    for layer, k, ns in _layers(s):
        for t in tokens:
            results += bench_case(s, layer, k, ns, t, impls, max(args.runs, 20), flush, platform)
            if args.aot_h100:
                aot_rows += aot_h100_case(s, layer, k, ns, t)
    _print_rows(results, ["layer", "rows", "arm", "median_us", "tflops", "rel_err_vs_fp8_float64",
                          "rel_err_vs_bf16_float64", "operand_bytes", "xla_flops",
                          "xla_bytes_accessed"])  # fmt: skip
    if aot_rows:
        print("\nH100 (deviceless compile): dot FLOPs and HBM bytes of the optimized HLO")
        _print_rows(aot_rows, ["layer", "rows", "arm", "hlo_dot_flops", "flops_over_useful",
                               "hlo_hbm_bytes", "pallas_kernels"])  # fmt: skip
    name = "cpu" if platform == "cpu" else dev.device_kind.replace(" ", "_").lower()
    path = pathlib.Path(
        args.out or pathlib.Path(REPO) / f"experiments/results/bench_moe_{name}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        git_sha=_git_sha(), jax_version=jax.__version__, device_kind=dev.device_kind,
        platform=platform, shape=dataclasses.asdict(s), tokens=list(tokens), impls=impls,
        distribution=DISTRIBUTION, runs=max(args.runs, 20), l2_flush=flush is not None,
        timing="wall clock of the jitted call; median, p20, p80 after 2 warm-up calls",
    )  # fmt: skip
    path.write_text(json.dumps(dict(meta=meta, results=results, aot_h100=aot_rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
