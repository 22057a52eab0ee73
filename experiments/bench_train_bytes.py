"""HBM bytes and GEMM FLOPs of one train micro-batch (loss + gradients), BF16 vs FP8, no device.

``jax.value_and_grad(rl.update.loss_fn)`` of Qwen3-8B at real widths is compiled for H100
deviceless (``kernels_pallas.aot``) for three arms: ``bf16`` (the BF16 loss forward, BF16
backward), ``fp8_fwd`` (``rl.train_precision="fp8_rollout"``: W8A8 forward through the Mosaic
GPU ``fp8_matmul``, BF16 backward GEMMs) and ``fp8_fwd_bwd`` (+ ``rl.fp8_backward``: DeepSeek-V3
FP8 dgrad through the kernel, FP8 1D1D wgrad through XLA). Counted from ``compiled.as_text()``
(``experiments.hlo_flops``): HBM bytes of the whole program (loops times their trip count),
XLA ``dot`` FLOPs by operand type, and the Mosaic kernels' GEMM FLOPs from their operand shapes.
Each arm is compiled with 1 and 2 layers; ``X(36) = X(1) + 35 · (X(2) − X(1))``.

  .aot/venv/bin/python experiments/bench_train_bytes.py [--rows 2] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from experiments import hlo_bytes, hlo_flops  # noqa: E402
from kernels_pallas import aot  # noqa: E402

FULL_LAYERS = 36
ARMS = (
    ("bf16", "bf16", False),
    ("fp8_fwd", "fp8_rollout", False),
    ("fp8_fwd_bwd", "fp8_rollout", True),
)


def _gemm_flops(hlo_text: str) -> dict:
    """{"dot_bf16": .., "dot_f8": .., "dot_f32": .., "mosaic": ..} FLOPs of one program."""
    comps = hlo_bytes.parse_hlo(hlo_text)
    out = {"dot_f8": 0, "dot_bf16": 0, "dot_f32": 0, "dot_other": 0, "mosaic": 0}

    def visit(name: str, mult: int) -> None:
        comp = comps[name]
        shapes = {i.name: i.shape for i in comp.instrs}
        for i in comp.instrs:
            if i.opcode == "dot":
                dt = shapes[i.operands[0]].split("[")[0]
                key = "dot_f8" if dt.startswith("f8") else f"dot_{dt}"
                out[key if key in out else "dot_other"] += mult * hlo_flops._dot(i, shapes)
            elif i.opcode == "custom-call" and "mosaic" in i.attrs:
                k = hlo_flops._dims(shapes[i.operands[0]])[-1]
                out["mosaic"] += mult * 2 * k * math.prod(hlo_flops._dims(i.shape.split("{")[0]))
            elif i.opcode == "while":
                visit(hlo_bytes._attr(i, "body")[0], mult * hlo_flops.trip_count(i))
            else:
                for c in hlo_bytes._attr(i, "calls") + hlo_bytes._attr(i, "to_apply"):
                    if c in comps:
                        visit(c, mult)

    entry = next(c for c in comps.values() if c.is_entry)
    visit(entry.name, 1)
    return out


def compile_arm(arm, layers: int, args) -> dict:
    import jax
    import jax.numpy as jnp

    from fp8rl_jax.generation import RolloutConfig, aot_cases
    from fp8rl_jax.models import init_weights
    from fp8rl_jax.rl import RLConfig
    from fp8rl_jax.rl.state import StepConfig, Trainable
    from fp8rl_jax.rl.update import MiniBatch, loss_fn

    _, precision, fp8_bwd = arm
    model = dataclasses.replace(aot_cases.QWEN3_8B, num_layers=layers)
    rl = RLConfig(train_precision=precision, fp8_backward=fp8_bwd)
    cfg = StepConfig(model, RolloutConfig(matmul_impl=args.matmul_impl), rl)
    params = jax.eval_shape(lambda: init_weights(model, jax.random.key(0), jnp.float32))
    sds, B, T = jax.ShapeDtypeStruct, args.rows, args.tokens
    i32, f32 = sds((B, T), jnp.int32), sds((B, T), jnp.float32)
    mb = MiniBatch(i32, i32, i32, f32, f32, f32, f32, f32)

    def grads(policy, mb):
        return jax.value_and_grad(loss_fn, has_aux=True)(Trainable(policy), mb, cfg)

    text = aot.compile_for("h100", grads, params, mb).compiled.as_text()
    return dict(hbm_bytes=hlo_flops.hbm_bytes(text), **_gemm_flops(text))


def measure(arm, args) -> dict:
    t0 = time.perf_counter()
    one, two = (compile_arm(arm, n, args) for n in (1, 2))
    full = {k: one[k] + (FULL_LAYERS - 1) * (two[k] - one[k]) for k in one}
    per_layer = {k: two[k] - one[k] for k in one}
    return dict(arm=arm[0], full=full, per_layer=per_layer, one_layer=one, two_layers=two,
                compile_s=round(time.perf_counter() - t0, 1))  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--matmul-impl", default="pallas_mosaic_gpu")
    p.add_argument(
        "--out", default=os.path.join(REPO, "experiments/results/bench_train_bytes.json")
    )
    args = p.parse_args(argv)
    aot.prepare_environment()
    import jax

    rows = [measure(arm, args) for arm in ARMS]
    print(f"Qwen3-8B loss+grad, {args.rows}x{args.tokens} tokens, H100 deviceless, 36 layers "
          f"(from 1 and 2)")  # fmt: skip
    print(f"{'arm':<12} {'GB':>8} {'GB/layer':>9} {'TFLOP bf16':>11} {'TFLOP f8':>9} "
          f"{'TFLOP mosaic':>13} {'TFLOP f32':>10}")  # fmt: skip
    for r in rows:
        f, pl = r["full"], r["per_layer"]
        print(f"{r['arm']:<12} {f['hbm_bytes'] / 1e9:>8.2f} {pl['hbm_bytes'] / 1e9:>9.3f} "
              f"{f['dot_bf16'] / 1e12:>11.2f} {f['dot_f8'] / 1e12:>9.2f} "
              f"{f['mosaic'] / 1e12:>13.2f} {f['dot_f32'] / 1e12:>10.2f}")  # fmt: skip
    with open(args.out, "w") as fh:
        json.dump(dict(jax=jax.__version__, target="h100", rows_per_mb=args.rows,
                       tokens=args.tokens, matmul_impl=args.matmul_impl, layers=FULL_LAYERS,
                       arms=rows), fh, indent=1)  # fmt: skip
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
