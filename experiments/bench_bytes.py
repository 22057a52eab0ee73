"""HBM bytes per generated token of a Qwen3-8B decode step at 8K context on H100, no device.

The rollout program (``fp8rl_jax.generation.aot_cases.rollout_program``: ``quantize_params`` +
``generate``) is compiled for H100 deviceless (``kernels_pallas.aot``) for three arms: BF16,
W8A8 (FP8 weights and activations, BF16 KV cache), and W8A8 + FP8 KV (static scales). XLA's cost
analysis is not available without a device, so the bytes are counted from
``compiled.as_text()`` by ``experiments.hlo_bytes``: one iteration of the decode while loop (body
and condition), every kernel's operands read and outputs written once, with slices counted by
the bytes sliced and in-place cache updates (dynamic-update-slice / scatter into a loop buffer)
by the bytes written, not the whole buffer (the full rule is in ``hlo_bytes``' docstring).

The cache holds ``--context`` slots and every one is counted as read (the state at the end of an
8K rollout; a length-aware kernel reads fewer early on, which a static count cannot see). One
iteration generates ``--batch`` tokens, so bytes per token = bytes per iteration / B. Layers:
each arm is compiled with 1 and 2 layers at the real widths; all 36 layers compile to the same
code, so ``bytes(36) = bytes(1) + 35 * (bytes(2) - bytes(1))`` (``--check-linear`` also compiles
3 layers and reports the deviation). The BF16 / FP8 ratio has a bandwidth limit of 2.0 (the BF16
``embed`` and ``lm_head`` stay BF16 in both, so slightly less); the target is >= 1.85.

  .aot/venv/bin/python experiments/bench_bytes.py [--batch 16] [--decode-impl pallas_mosaic_gpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from experiments import hlo_bytes  # noqa: E402
from kernels_pallas import aot  # noqa: E402

FULL_LAYERS = 36
# (arm, FP8 weights?, KV cache dtype)
ARMS = (
    ("bf16", False, "bfloat16"),
    ("w8a8", True, "bfloat16"),
    ("w8a8_fp8kv", True, "float8_e4m3fn"),
)


def iteration_bytes(arm: tuple, layers: int, args) -> hlo_bytes.LoopBytes:
    """Bytes of one decode iteration of the rollout program with ``layers`` layers."""
    from fp8rl_jax.generation import aot_cases
    from fp8rl_jax.quant import QuantRecipe
    from kernels_pallas.backend import KernelImpls

    _, fp8_weights, kv_dtype = arm
    cfg = dataclasses.replace(aot_cases.QWEN3_8B, num_layers=layers)
    shape = aot_cases.RolloutShape(args.batch, args.prompt_len, args.context - args.prompt_len)
    kernels = KernelImpls(matmul=args.matmul_impl, decode_attention=args.decode_impl)
    recipe = QuantRecipe() if fp8_weights else None
    fn = aot_cases.rollout_program(cfg, shape, recipe, kv_dtype, kernels)
    result = aot.compile_for("h100", fn, *aot_cases.rollout_args(cfg, shape))
    return hlo_bytes.loop_iteration_bytes(result.compiled.as_text())


def measure(arm: tuple, args) -> dict:
    t0 = time.perf_counter()
    counts = {n: iteration_bytes(arm, n, args) for n in (1, 2, 3)[: 3 if args.check_linear else 2]}
    per_layer = counts[2].total - counts[1].total
    total = counts[1].total + (FULL_LAYERS - 1) * per_layer
    out = dict(
        arm=arm[0], bytes_1_layer=counts[1].total, bytes_2_layers=counts[2].total,
        bytes_per_layer=per_layer, bytes_per_iteration=total,
        bytes_per_token=total / args.batch, nested_loops=counts[2].nested_loops,
        top_kernels_2_layers=[list(t) for t in counts[2].per_instr[:12]],
        compile_s=round(time.perf_counter() - t0, 1),
    )  # fmt: skip
    if args.check_linear:
        predicted = counts[1].total + 2 * per_layer
        out["linearity_error_3_layers"] = (counts[3].total - predicted) / counts[3].total
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=16, help="rows decoded per iteration (B)")
    p.add_argument("--context", type=int, default=8192, help="KV cache slots (P + N)")
    p.add_argument("--prompt-len", type=int, default=128, help="P (prefill is outside the loop)")
    p.add_argument("--decode-impl", default=None, help="KernelImpls.decode_attention; None: jnp")
    p.add_argument("--matmul-impl", default="auto", help="KernelImpls.matmul (W8A8 layers)")
    p.add_argument("--check-linear", action="store_true", help="also compile 3 layers")
    p.add_argument("--out", default=os.path.join(REPO, "experiments/results/bench_bytes.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    import jax

    args = parse_args(argv)
    aot.prepare_environment()
    rows = [measure(arm, args) for arm in ARMS]
    bf16 = rows[0]["bytes_per_token"]
    for r in rows:
        r["ratio_bf16_over_arm"] = bf16 / r["bytes_per_token"]
    print(
        f"Qwen3-8B decode step, {FULL_LAYERS} layers (from 1 and 2), B={args.batch}, "
        f"{args.context}-slot cache, H100 deviceless, decode_impl={args.decode_impl}"
    )
    print(f"{'arm':<12} {'GB/iteration':>13} {'MB/token':>10} {'MB/layer':>10} {'BF16/arm':>9}")
    for r in rows:
        print(
            f"{r['arm']:<12} {r['bytes_per_iteration'] / 1e9:>13.2f} "
            f"{r['bytes_per_token'] / 1e6:>10.1f} {r['bytes_per_layer'] / 1e6:>10.1f} "
            f"{r['ratio_bf16_over_arm']:>9.3f}"
        )
    ratio = rows[-1]["ratio_bf16_over_arm"]
    print(f"BF16 / (W8A8 + FP8 KV) = {ratio:.3f} (bandwidth limit 2.0, target >= 1.85)")
    sha = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True)
    report = dict(
        git_sha=sha.stdout.strip(), jax=jax.__version__, target="h100", layers=FULL_LAYERS,
        batch=args.batch, context=args.context, prompt_len=args.prompt_len,
        decode_impl=args.decode_impl, matmul_impl=args.matmul_impl,
        ratio_bf16_over_fp8=ratio, arms=rows,
    )  # fmt: skip
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
