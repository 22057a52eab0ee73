"""Benchmark per-token FP8 activation quantization: XLA's fusions against the one-launch kernels.

Rows per op and shape, both arms timed in the same run over the same operands:
  * ``xla``: the pure-jnp reference compiled by XLA (``quantize_activations``, or the producer
    and the quantization: ``rmsnorm_quantize_reference``, ``swiglu_quantize_reference``), which
    the deviceless H100 compile splits into two to three fusions that read x twice;
  * ``pallas_triton``: the ``act_quantize`` kernel (``quantize_activations_triton``,
    ``rmsnorm_quantize_triton``, ``swiglu_quantize_triton``): one launch, x read once. Since
    this benchmark was written, ``fp8_matmul`` and the model's producers take these kernels at
    every M on Hopper (they did up to 256 rows); the first H200 run measured XLA's standalone
    quantization at 31 us for [4096, 4096] and 83 us for [4096, 12288] (the ``+quant`` rows of
    ``bench_matmul``), the performance model predicts the kernel at 17 and 47 us
    (``perf_model.gpu.quantize_s``).
Reported: median / p20 / p80 per op (CUPTI kernel time on GPU, else the wall clock), GB/s over
the kernel's bytes (BF16 inputs read once, FP8 values and f32 scales written) and its fraction
of the HBM peak, the speedup over ``xla``, and the fraction of FP8 codes equal to XLA's
(``quantize``: 1, bit for bit; the producers ~0.98: XLA keeps f32 between the fused producer
ops (excess precision) where the kernels round to the activations' dtype as the unfused ops do,
and on a GPU Triton's exp/rsqrt may differ in the last bit).

Usage: ``python experiments/bench_quantize.py --quick`` (CPU: tiny shapes, the kernels in
interpret mode); on a Hopper GPU without flags (3 ops x 4 M x 2 arms, ~1 s of compile each);
``--out PATH.json`` (a ``.md`` table beside it).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import bench_common as bc  # noqa: E402
from kernels_pallas.act_quantize import fused, quantize_activations_triton  # noqa: E402
from kernels_pallas.act_quantize.reference import (  # noqa: E402
    rmsnorm_quantize_reference,
    split_gate_up,
    swiglu_quantize_reference,
)
from kernels_pallas.quantize import quantize_activations  # noqa: E402

GPU_M = (4096, 16, 256, 16384)  # prefill first (what changed), then decode, a long prefill
CPU_M = (16, 64)
# (op, input width K) at Qwen3-8B widths: D = 4096, F = 12288
GPU_OPS = (("quantize", 4096), ("quantize", 12288), ("rmsnorm+quantize", 4096),
           ("swiglu+quantize", 12288))  # fmt: skip
CPU_OPS = (("quantize", 256), ("rmsnorm+quantize", 256), ("swiglu+quantize", 256))
EPS = 1e-6


def _operands(key, op: str, m: int, k: int) -> dict:
    kx, kw = jax.random.split(key)
    if op == "swiglu+quantize":  # the fused gate|up GEMM's output [M, 2F]
        return dict(x=jax.random.normal(kx, (m, 2 * k), jnp.bfloat16))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (1.0 + 0.3 * jax.random.normal(kw, (k,))).astype(jnp.bfloat16)
    return dict(x=x, w=w)


def _op(op: str, impl: str, interpret: bool):
    """The op over one operand set -> (FP8 values, scales)."""
    kern = impl == "pallas_triton"

    def fn(s):
        if op == "quantize":
            q = (quantize_activations_triton(s["x"], interpret=interpret) if kern
                 else quantize_activations(s["x"]))  # fmt: skip
        elif op == "rmsnorm+quantize":
            q = (fused.rmsnorm_quantize_triton(s["x"], s["w"], EPS, interpret=interpret) if kern
                 else rmsnorm_quantize_reference(s["x"], s["w"], EPS))  # fmt: skip
        else:
            q = (fused.swiglu_quantize_triton(s["x"], interpret=interpret) if kern
                 else swiglu_quantize_reference(*split_gate_up(s["x"], 128)))  # fmt: skip
        return q.values, q.scales

    return fn


def kernel_bytes(op: str, m: int, k: int) -> int:
    """The one-read bytes: BF16 inputs (x; gate and up), FP8 values and f32 scales written."""
    inputs = m * k * 2 * (2 if op == "swiglu+quantize" else 1)
    return inputs + m * k + m * (k // 128) * 4


def bench_op(op: str, m: int, k: int, runs: int, interpret: bool) -> list[dict]:
    platform = jax.devices()[0].platform
    reps = bc.rotations(kernel_bytes(op, m, k), platform)
    sets = [_operands(jax.random.key(1000 * i + m + k), op, m, k) for i in range(reps)]
    rows, ref = [], None
    for impl in ("xla", "pallas_triton"):
        row = dict(op=op, m=m, k=k, impl=impl)
        try:
            one = _op(op, impl, interpret)
            compiled, compile_s = bc.compile_fn(lambda ss, one=one: [one(s) for s in ss], sets)
            t = bc.time_compiled(compiled, (sets,), runs=runs, reps=reps, compile_s=compile_s)
            values, _ = compiled(sets)[0]
            codes = np.asarray(values[:m]).view(np.uint8)
            ref = codes if ref is None else ref
            sec = float(np.median(t.best))
            gbps = kernel_bytes(op, m, k) / sec / 1e9
            peak = bc.peaks(jax.devices()[0].device_kind).hbm_bytes_s
            row |= t.summary() | dict(
                gbps=gbps, of_hbm_peak=gbps * 1e9 / peak if peak else None,
                codes_equal_xla=float(np.mean(codes == ref)),
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - one failed arm must not end the run
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        rows.append(row)
    base = rows[0].get("median_us")
    for r in rows:
        if base and r.get("median_us"):
            r["speedup_vs_xla"] = base / r["median_us"]
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    head = ["op", "M", "K", "impl", "median us", "p20", "p80", "GB/s", "of HBM peak", "x xla",
            "codes = xla", "timer"]  # fmt: skip
    body = [[r["op"], r["m"], r["k"], r["impl"], r.get("median_us"), r.get("p20_us"),
             r.get("p80_us"), r.get("gbps"), r.get("of_hbm_peak"), r.get("speedup_vs_xla"),
             r.get("codes_equal_xla"), r.get("timer", r.get("error"))] for r in rows]  # fmt: skip
    title = f"## FP8 activation quantization: XLA vs act_quantize ({meta['device_kind']}, " \
        f"jax {meta['jax']})\n\n"  # fmt: skip
    return title + bc.md_table(head, body)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU: tiny shapes, interpret mode")
    ap.add_argument("--runs", type=int, default=None, help="timed calls per arm (GPU 20, CPU 3)")
    ap.add_argument("--ms", type=int, nargs="*", default=None, help="override the M values")
    ap.add_argument("--out", default=None, help="JSON path (default results/bench_quantize_<dev>)")
    args = ap.parse_args(argv)
    on_gpu = jax.devices()[0].platform == "gpu"
    ops, ms = (GPU_OPS, GPU_M) if on_gpu and not args.quick else (CPU_OPS, CPU_M)
    ms = tuple(args.ms) if args.ms else ms
    runs = args.runs or (20 if on_gpu else 3)
    interpret = not on_gpu
    meta = bc.env_meta() | dict(bench="quantize", quick=args.quick, runs=runs,
                                interpret=interpret)  # fmt: skip
    out = args.out or bc.default_out("bench_quantize")
    rows = []
    print(f"device={meta['device_kind']} jax={meta['jax']} runs={runs} interpret={interpret}")
    for m in ms:
        for op, k in ops:
            new = bench_op(op, m, k, runs, interpret)
            rows += new
            for r in new:
                us, x = r.get("median_us", float("nan")), r.get("speedup_vs_xla", float("nan"))
                print(f"{op:<18} {m:>6} {k:>6} {r['impl']:<14} {us:>10.1f} us x{x:.2f} "
                      f"{r.get('error', '')}")  # fmt: skip
            bc.write_results(out, meta, rows, markdown(meta, rows))
    print(f"wrote {out}")
    return dict(meta=meta, rows=rows)


if __name__ == "__main__":
    main()
