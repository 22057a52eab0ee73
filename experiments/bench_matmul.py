"""Benchmark blockwise FP8 ``fp8_matmul`` against BF16 ``jnp.dot`` in the same run.

Rows per shape (M, N, K):
  * ``bf16``: ``jnp.dot`` of BF16 x [M, K] and w [K, N], f32 accumulation, BF16 out (cuBLAS on
    GPU): the baseline;
  * ``fp8:<impl>``: the GEMM alone (x already a per-token FP8 QArray), for ``xla`` (the fallback
    ``auto`` uses: FP8 GEMMs batched over K blocks for M <= 32, BF16 dequantize + BF16 GEMM
    above; the exact reference on CPU) and the target's kernel (``pallas_mosaic_gpu`` on Hopper);
  * ``fp8:<kernel>+quant``: from BF16 x, as the model calls it (activation quantization timed:
    once, by the ``act_quantize`` kernel on Hopper (by XLA elsewhere; on Hopper by XLA above
    256 rows until 2026-12-04: the first H200 run's rows), then the QArray kernel; on Hopper at
    M = 16 in-kernel, by the fused decode kernel, one launch: the row's ``fused``), and at
    that M ``fp8:<kernel>+quant:once``: the quantize-once path beside it;
  * on Hopper, the default tile's neighbours where they differ from it: ``:plain`` (without
    promotions under the wgmmas or two-slice stages), ``:nopdl`` (launched plainly) and
    ``:rules`` (the rules' tile where the dispatch's performance model picked another,
    ``fp8_matmul.tile_choice``);
  * at M <= 64, ``bf16+add`` and ``fp8:<kernel>+add``: the GEMM as the rollout program runs it,
    followed by its consumer (a residual add of a BF16 [M, N] ``r``), x already FP8 (quantized
    by its producer's kernel in the program): XLA fuses the split-K partials' sum into that
    add, so a split tile's sum costs no fusion of its own (the issue-21 "in the rollout
    program" target, ``perf_model.gpu.predict_matmul(in_program=True)``); its speedup is over
    ``bf16+add``.
Reported per row: median / p20 / p80 time per GEMM (CUPTI kernel time on GPU, else the wall
clock; see ``bench_common``), TFLOP/s = 2MNK / t, GB/s over the operand bytes (x, w, y at their
stored widths, scales included), the speedup over ``bf16``, and the relative Frobenius error of
the output against the BF16 product (a sanity check: ~0.03-0.05 for E4M3; a broken kernel shows).

Data: x ~ N(0, 1) BF16; w ~ N(0, 1) / sqrt(K) BF16, quantized with real amax scales (1x128
activation groups, 128x128 weight blocks, E4M3). Shapes on GPU: DeepSeek-V3 and Qwen3-8B linear
layers at M in {4096, 16, 64, 8192} (issue 11's targets: >= 1.5x BF16 at M = 4096, >= 1.6x at
M <= 64), then 128 (a decode batch past 64 rows: swap-AB with split-K where the model says).
On CPU (``--quick``: tiny shapes) FP8 is emulated (dequantize, f32 dot): the speedup says
nothing about FP8; the run checks the code paths. ``--interpret`` adds the Hopper kernel in
interpret mode (CPU, slow: correctness of the path only).

Usage: ``python experiments/bench_matmul.py --quick`` (CPU, ~10 s); on a GPU without flags
(156 compiled programs: 6 layers x 5 M x 4 arms, and the 2 "+add" arms at M 16, 64, 128; the
first GPU run tells how long; rows are written after each shape, so a cut run keeps the
first M values); ``--out PATH.json`` (a ``.md`` table beside it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import bench_common as bc  # noqa: E402
from kernels_pallas.backend import prepare_gpu_interpret  # noqa: E402
from kernels_pallas.fp8_matmul import api as fp8_api  # noqa: E402
from kernels_pallas.fp8_matmul import default_impl, fp8_matmul  # noqa: E402
from kernels_pallas.quantize import quantize_activations, quantize_weight  # noqa: E402

GPU_M = (4096, 16, 64, 8192, 128)  # the targets' M first, so a cut run still has them
GPU_LAYERS = (  # (model, layer, N, K)
    ("Qwen3-8B", "q|k|v fused", 6144, 4096),  # the FP8 rollout's one GEMM (models/fused.py)
    ("Qwen3-8B", "o_proj", 4096, 4096),
    ("DeepSeek-V3", "q_a+kv_a_proj", 2112, 7168),
    ("DeepSeek-V3", "o_proj", 7168, 16384),
    ("Qwen3-8B", "gate|up_proj", 12288, 4096),
    ("Qwen3-8B", "down_proj", 4096, 12288),
)
CPU_M = (16, 128)
CPU_LAYERS = (("tiny", "square", 256, 256), ("tiny", "wide", 512, 256))
DISTRIBUTION = "x ~ N(0,1) bf16; w ~ N(0,1)/sqrt(K) bf16; E4M3, 1x128 / 128x128 amax scales"
_H100 = jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132
)


@functools.partial(jax.jit, static_argnames=("m", "n", "k"))
def _operands(key, *, m, n, k):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    r = jax.random.normal(jax.random.fold_in(key, 2), (m, n), jnp.bfloat16)  # a residual
    return dict(x=x, w=w, xq=quantize_activations(x), wq=quantize_weight(w), r=r)  # wq: [N, K]


def _bf16(s):
    return jnp.dot(s["x"], s["w"], preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _fp8(s, *, impl, raw, interpret, config=None):
    x = s["x"] if raw else s["xq"]
    return fp8_matmul(x, s["wq"], out_dtype=jnp.bfloat16, impl=impl, interpret=interpret,
                      config=config)  # fmt: skip


MGPU = "pallas_mosaic_gpu"
# The Hopper kernel's tiles before its latest changes (prefill: promotions under the wgmmas,
# ``MgpuConfig.overlap``; decode: two 128-K slices per pipeline step, ``MgpuConfig.k_slices``),
# timed beside the default where the two differ: the arm ``fp8:<MGPU>:plain``.
PLAIN = ":plain"
# The decode default launched after its predecessor completes, not dependent (``MgpuConfig.pdl``):
# the arm ``fp8:<MGPU>:nopdl``. What it changes is the gap between kernels, which CUPTI's kernel
# time leaves out: compare the rows' wall clock per GEMM (``wall us``, ``x bf16 (wall)``).
NOPDL = ":nopdl"
# The dispatch runs the tile its performance model ranks fastest where it beats the rules'
# tile by a margin (``fp8_matmul.tile_choice``): the arm ``fp8:<MGPU>:rules`` times
# the rules' tile beside it wherever they differ, so a device run judges the model's pick.
RULES = ":rules"
# Raw x at decode M runs the fused kernel (``+quant``: x quantized in-kernel, one launch) where
# ``fused_default`` says; the arm ``fp8:<MGPU>+quant:once`` times the quantize-once path
# (``act_quantize``, then the QArray kernel) beside it.
ONCE = "+quant:once"


def arm_config(label: str, m: int, n: int, k: int) -> dict | None:
    """The Hopper tile config an arm runs, as its row records it (None for other arms)."""
    if not label.startswith(f"fp8:{MGPU}"):
        return None
    if arm_fused(label, m, n, k):  # the fused kernel's dispatch tile
        from kernels_pallas.fp8_matmul import tile_choice

        chip = tile_choice.chip_of(jax.devices()[0].device_kind)
        return dataclasses.asdict(tile_choice.dispatch_config(m, n, k, fused=True, chip=chip))
    return dataclasses.asdict(hopper_config(m, n, k, label.removeprefix(f"fp8:{MGPU}")
                                            .split("+")[0]))  # fmt: skip


def arm_fused(label: str, m: int, n: int, k: int) -> bool:
    """Whether an arm runs the fused (in-kernel quantization) kernel: ``+quant`` where
    ``fused_default`` says (16 rows; 32 or 64 where the model picks it)."""
    return label == f"fp8:{MGPU}+quant" and fp8_api.fused_default(m, n, k)


def hopper_config(m: int, n: int, k: int, arm: str = ""):
    """The tile config the Hopper kernel runs for an arm (QArray x, BF16 out): the dispatch's
    (``fp8_matmul.tile_choice.dispatch_config`` on this device's constants), (``NOPDL``) the same
    launched without ``pdl``, (``RULES``) the rules' tile the dispatch's model replaced, or
    (``PLAIN``) the rules' tile without ``overlap`` or ``k_slices``."""
    from kernels_pallas.fp8_matmul import mgpu_config, tile_choice

    if arm == PLAIN:
        return mgpu_config.default_config(m, n, k, overlap=False, k_slices=False)
    if arm == RULES:
        return mgpu_config.default_config(m, n, k)
    chip = tile_choice.chip_of(jax.devices()[0].device_kind)
    cfg = tile_choice.dispatch_config(m, n, k, chip=chip)
    return dataclasses.replace(cfg, pdl=False) if arm == NOPDL else cfg


def _quantized_once(s, *, interpret):
    """Raw x quantized once by ``act_quantize``, then the QArray kernel's default tile: what
    ``+quant`` ran at every M before the fused decode kernel (``fp8_api.fused_default``)."""
    m = s["x"].shape[0]
    xq = fp8_api.quantize_once(s["x"], s["wq"], interpret=interpret)
    return fp8_matmul(xq, s["wq"], out_dtype=jnp.bfloat16, impl=MGPU, interpret=interpret)[:m]


def _plus_residual(op):
    """``op(s) + r``: the GEMM and its consumer in one program."""
    return lambda s: op(s) + s["r"]


ADD_MAX_M = 128  # the "+add" (GEMM and its consumer) arms run at decode M only


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _arms(impls: list[str], interpret: bool, m: int, n_k: tuple[int, int] = (128, 128)):
    """(label, op over one operand set, the set's operands it reads)."""
    arms = [("bf16", _bf16, ("x", "w"))]
    for impl in impls:
        op = functools.partial(_fp8, impl=impl, raw=False, interpret=interpret)
        arms.append((f"fp8:{impl}", op, ("xq", "wq")))
    for arm in (PLAIN, NOPDL, RULES) if MGPU in impls else ():
        if (cfg := hopper_config(m, *n_k, arm)) != hopper_config(m, *n_k):
            op = functools.partial(_fp8, impl=MGPU, raw=False, interpret=interpret, config=cfg)
            arms.append((f"fp8:{MGPU}{arm}", op, ("xq", "wq")))
    quant = functools.partial(_fp8, impl=impls[-1], raw=True, interpret=interpret)
    arms.append((f"fp8:{impls[-1]}+quant", quant, ("x", "wq")))
    if impls[-1] == MGPU and fp8_api.fused_default(m, *n_k):  # the fused kernel's baseline
        arms.append((f"fp8:{MGPU}{ONCE}", functools.partial(_quantized_once, interpret=interpret),
                     ("x", "wq")))  # fmt: skip
    if m <= ADD_MAX_M:
        kernel = functools.partial(_fp8, impl=impls[-1], raw=False, interpret=interpret)
        arms.append(("bf16+add", _plus_residual(_bf16), ("x", "w", "r")))
        arms.append((f"fp8:{impls[-1]}+add", _plus_residual(kernel), ("xq", "wq", "r")))
    return arms


def baseline_of(label: str) -> str:
    """The arm a row's speedup is over: ``bf16+add`` for the GEMM-and-consumer arms."""
    return "bf16+add" if label.endswith("+add") else "bf16"


def _rel_err(y, ref) -> float:
    y, ref = (jnp.asarray(a, jnp.float32) for a in (y, ref))
    return float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))


def bench_shape(model, layer, m, n, k, impls, runs, interpret) -> list[dict]:
    """Every arm at one shape, timed over the same rotating operand sets."""
    platform = jax.devices()[0].platform
    set_bytes = 2 * (m * k + k * n + m * n)  # the BF16 operands of one set
    reps = bc.rotations(set_bytes, platform)
    sets = [_operands(jax.random.key(1000 * i + m + n + k), m=m, n=n, k=k) for i in range(reps)]
    rows, refs = [], {}
    for label, op, reads in _arms(impls, interpret, m, (n, k)):
        row = dict(model=model, layer=layer, m=m, n=n, k=k, impl=label)
        if (cfg := arm_config(label, m, n, k)) is not None:  # the tiles it ran (for the model)
            row["config"] = cfg
            row["fused"] = arm_fused(label, m, n, k)
        try:
            args = [{r: s[r] for r in reads} for s in sets]
            fn = lambda ss, op=op: [op(s) for s in ss]
            compiled, compile_s = bc.compile_fn(fn, args)
            t = bc.time_compiled(compiled, (args,), runs=runs, reps=reps, compile_s=compile_s)
            y = compiled(args)[0]
            if label == baseline_of(label):
                refs[label] = y
            ref = refs.get(baseline_of(label))
            sec = float(np.median(t.best))
            row |= t.summary() | dict(
                tflops=2 * m * n * k / sec / 1e12,
                gbps=(_nbytes(args[0]) + m * n * 2) / sec / 1e9,
                rel_err_vs_bf16=None if ref is None else _rel_err(y, ref),
            )
        except Exception as e:  # noqa: BLE001 - one failed arm must not end the run
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        rows.append(row)
    for key, out in (("median_us", "speedup_vs_bf16"), ("wall_median_us", "wall_speedup_vs_bf16")):
        base = {r["impl"]: r.get(key) for r in rows}
        for r in rows:
            b = base.get(baseline_of(r["impl"]))
            if b and r.get(key):
                r[out] = b / r[key]
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    head = ["M", "N", "K", "layer", "impl", "median us", "p20", "p80", "TFLOP/s", "GB/s",
            "x bf16", "wall us", "x bf16 (wall)", "rel err", "timer"]  # fmt: skip
    body = [
        [r["m"], r["n"], r["k"], f"{r['model']} {r['layer']}", r["impl"], r.get("median_us"),
         r.get("p20_us"), r.get("p80_us"), r.get("tflops"), r.get("gbps"),
         r.get("speedup_vs_bf16"), r.get("wall_median_us"), r.get("wall_speedup_vs_bf16"),
         r.get("rel_err_vs_bf16"), r.get("timer", r.get("error"))]
        for r in rows
    ]  # fmt: skip
    title = f"## fp8_matmul vs BF16 jnp.dot ({meta['device_kind']}, jax {meta['jax']})\n\n"
    return title + bc.md_table(head, body)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU: tiny shapes, 5 runs")
    ap.add_argument("--runs", type=int, default=None, help="timed calls per arm (GPU 20, CPU 5)")
    ap.add_argument("--ms", type=int, nargs="*", default=None, help="override the M values")
    ap.add_argument("--impls", nargs="*", default=None, help="FP8 impls (default: xla + target)")
    ap.add_argument("--interpret", action="store_true", help="add the Hopper kernel, interpreted")
    ap.add_argument("--out", default=None, help="JSON path (default results/bench_matmul_<dev>)")
    args = ap.parse_args(argv)
    if args.interpret:  # before the first computation (backend.GPU_INTERPRET_XLA_FLAG)
        prepare_gpu_interpret()
    on_gpu = jax.devices()[0].platform == "gpu"
    layers, ms = (GPU_LAYERS, GPU_M) if on_gpu and not args.quick else (CPU_LAYERS, CPU_M)
    if args.quick:
        layers = layers[:1]
    ms = tuple(args.ms) if args.ms else ms
    impls = args.impls or list(dict.fromkeys(["xla", default_impl()]))
    if args.interpret and "pallas_mosaic_gpu" not in impls:
        impls.append("pallas_mosaic_gpu")
    runs = args.runs or (20 if on_gpu else 5)
    meta = bc.env_meta() | dict(
        bench="matmul", quick=args.quick, runs=runs, impls=impls, interpret=args.interpret,
        distribution=DISTRIBUTION, peaks=vars(bc.peaks(jax.devices()[0].device_kind)),
        timing=bc.__doc__.split("\n\n")[1].replace("\n", " "),
    )  # fmt: skip
    out = args.out or bc.default_out("bench_matmul")
    ctx = jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((), (), abstract_device=_H100)
    ) if args.interpret else contextlib.nullcontext()  # fmt: skip
    rows = []
    print(f"device={meta['device_kind']} jax={meta['jax']} impls={impls} runs={runs}")
    for m in ms:
        for model, layer, n, k in layers:
            with ctx:
                new = bench_shape(model, layer, m, n, k, impls, runs, args.interpret)
            rows += new
            for r in new:
                nan = float("nan")
                us, tf, x = (r.get(f, nan) for f in ("median_us", "tflops", "speedup_vs_bf16"))
                print(f"{m:>5} {n:>6} {k:>6} {r['impl']:<32} {us:>10.1f} us {tf:>8.2f} TF/s "
                      f"x{x:.2f} {r.get('error', '')}")  # fmt: skip
            bc.write_results(out, meta, rows, markdown(meta, rows))
    print(f"wrote {out}")
    return dict(meta=meta, rows=rows)


if __name__ == "__main__":
    main()
