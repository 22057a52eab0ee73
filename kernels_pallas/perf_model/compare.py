"""Measured beside predicted: ``python -m kernels_pallas.perf_model.compare BENCH_JSON...``.

Reads ``experiments/bench_matmul.py`` / ``bench_decode.py`` / ``bench_moe.py`` output
(``meta.device_kind``, rows with ``m, n, k, impl, median_us``, ``b, s, h, k, c, cache, impl,
median_us`` or ``layer, rows, experts, k, n, arm, median_us``) and prints, per fp8_matmul row,
per full-length decode attention row and per Hopper grouped row (FP8, and BF16 ``gmm``), the
measured time beside the model's prediction for the same arm (``fp8:<impl>``: QArray x;
``+quant``: BF16 x quantized once; ``bf16``: the BF16 baseline; ``+add``: the GEMM and its
consumer; ``pallas_mosaic_gpu[:unswapped]``: decode attention, ``predicted_us``), and measured
/ predicted: the calibration of the model's knobs (``gpu.py`` constants) the first time it runs
on a device.
"""

from __future__ import annotations

import json
import os
import sys

from kernels_pallas.perf_model import gpu, gpu_attention


def chip_of(device_kind: str) -> str | None:
    kind = device_kind.lower()
    return "h200" if "h200" in kind else "h100" if "h100" in kind else None


def predicted_us(chip: str, row: dict) -> float | None:
    """The model's time for one bench_matmul row; ``+add`` arms (the GEMM and its residual-add
    consumer, x FP8) are the GEMM in the rollout program (``in_program``: the split-K sum fused
    into the add) plus the add's own fusion, which the BF16 program runs too."""
    if "cache" in row:
        return _attention_us(chip, row)
    if "arm" in row:
        return _grouped_us(chip, row)
    m, n, k, impl = row.get("m"), row.get("n"), row.get("k"), row.get("impl", "")
    if None in (m, n, k) or k % 128 or n % 64:
        return None
    add = gpu.add_fusion_s(chip, m, n) if impl.endswith("+add") else 0.0
    if impl in ("bf16", "bf16+add"):
        return (gpu.bf16_gemm_s(chip, m, n, k) + add) * 1e6
    if impl.startswith("fp8:pallas_mosaic_gpu"):
        # raw x: in-kernel (``fused``: rows since the fused decode kernel) or quantized once
        x = "bf16" if "+quant" in impl else "fp8"
        mode = "fused" if row.get("fused") else "qarray" if x == "bf16" else "default"
        p = gpu.predict_matmul(chip, m, n, k, x, mode=mode, in_program=impl.endswith("+add"),
                               config=matmul_config(row))  # fmt: skip
        return (p.time_s + add) * 1e6
    return None


def matmul_config(row: dict):
    """The Hopper tile config a bench_matmul row ran: recorded (``config``), or for rows of
    runs before it was (the H200 run of 2026-12-04) the default of then, without ``overlap``,
    ``k_slices`` or ``pdl``."""
    from kernels_pallas.fp8_matmul import mgpu_config

    if row.get("config"):
        return mgpu_config.MgpuConfig(**row["config"])
    return mgpu_config.default_config(row["m"], row["n"], row["k"], overlap=False,
                                      k_slices=False, pdl=False)  # fmt: skip


# bench_decode rows without ``num_stages`` (the H200 run of 2026-12-04) ran the defaults of then
# (3 stages on an FP8 cache, 2 on BF16) or their arm's (``:st5``)
_LEGACY_STAGES = {"fp8": 3, "bf16": 2}


def ring_depth(row: dict) -> int:
    """The K/V ring depth a bench_decode row of the Hopper kernel ran at."""
    if row.get("num_stages"):
        return row["num_stages"]
    arm = row.get("impl", "").partition(":")[2]
    if arm.startswith("st"):
        return int(arm[2:])
    return _LEGACY_STAGES["bf16" if row["cache"] == "bf16" else "fp8"]


def attention_prediction(chip: str, row: dict):
    """The model's ``Prediction`` for one bench_decode row of the Hopper kernel (swap-AB,
    ``:unswapped``, ``:bs128``, ``:st3`` / ``:st5``) at its ring depth (``ring_depth``) and its
    launch (``pdl``: rows of the runs before it launched plainly) with every slot live (the
    model reads full rows); None for the rest. Its terms carry the tile
    (``block_s``) and chunk count (``splits``) it ran."""
    impl = row.get("impl", "")
    if row.get("lengths") != "full" or not impl.startswith("pallas_mosaic_gpu"):
        return None
    cache = "bf16" if row["cache"] == "bf16" else "fp8"
    return gpu_attention.predict_attention(chip, "decode_attention", row["b"], row["s"], row["h"],
                                 row["k"], row["c"], cache,
                                 swap_ab=not impl.endswith(":unswapped"),
                                 block_s=128 if impl.endswith(":bs128") else None,
                                 stages=ring_depth(row),
                                 pdl=row.get("pdl", False))  # fmt: skip


def _attention_us(chip: str, row: dict) -> float | None:
    p = attention_prediction(chip, row)
    return None if p is None else p.time_s * 1e6


def _grouped_us(chip: str, row: dict) -> float | None:
    """The model's time for a bench_moe row of a Hopper grouped kernel. ``grouped_fp8`` (FP8 x;
    gate+up as two equal stacks in one launch): bench_moe times the whole jitted call by the
    wall clock (the tile map, the scales' transpose and the gather included, as the model
    counts them). ``bf16_grouped`` (``grouped_matmul``'s forward, the BF16 scoring pass's
    experts): one ``gmm`` per stack, and for gate+up the concatenation of the two outputs (one
    fusion: read and written). bench_moe routes tokens at random (the model spreads them
    evenly)."""
    arm = row.get("arm")
    if arm not in ("grouped_fp8:pallas_mosaic_gpu", "bf16_grouped:pallas_mosaic_gpu") or \
            "experts" not in row:  # fmt: skip
        return None
    from kernels_pallas.perf_model import gpu_grouped

    stacks = 2 if row.get("layer") == "gate+up" else 1
    ns = (row["n"] // stacks,) * stacks
    rows, e, k = row["rows"], row["experts"], row["k"]
    if arm.startswith("grouped_fp8"):
        return gpu_grouped.predict_grouped_fp8(chip, rows, e, k, ns).time_s * 1e6
    t = stacks * gpu_grouped.predict_grouped_bf16(chip, rows, rows, e, k, ns[0], "fwd").time_s
    if stacks > 1:
        t += 2 * rows * row["n"] * 2 / gpu.CHIPS[chip].hbm_bytes_per_s + gpu.LAUNCH_S
    return t * 1e6


def _shape(row: dict) -> str:
    if "arm" in row:
        return f"{row.get('layer')} rows={row['rows']} E={row.get('experts')} K={row['k']} " \
               f"N={row['n']}"  # fmt: skip
    if "cache" in row:
        return f"B={row['b']} S={row['s']} H/K={row['h']}/{row['k']} {row['cache']}"
    return f"M={row['m']} N={row['n']} K={row['k']}"


def rows_beside(paths: list[str]) -> list[str]:
    """One line per modelled row. "measured" is the bench's median (on a GPU the CUPTI sum of
    the op's kernel durations, which leaves out the gaps between launches); "wall" the wall
    clock per op (a call runs the op over several operand sets, so host dispatch is spread
    over them and the launch gaps are in). The model charges ``gpu.LAUNCH_S`` per kernel or
    fusion, so at decode sizes the two bracket it: the first run says where launches go."""
    out = ["| bench | shape | impl | measured (us) | wall (us) | predicted (us) | "
           "measured/predicted | wall/predicted |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:  # a stage cut (or not run) before it wrote its rows
            out.append(f"| {path} | (not read: {type(e).__name__}) |")
            continue
        chip = chip_of(data.get("meta", {}).get("device_kind", ""))
        if chip is None:
            out.append(f"| {path} | (device {data.get('meta', {}).get('device_kind')}: no model) |")
            continue
        for row in data.get("rows") or data.get("results") or []:  # bench_moe: "results"
            pred, meas = predicted_us(chip, row), row.get("median_us")
            if pred is None or meas is None:
                continue
            shape = _shape(row)
            wall = row.get("wall_median_us")
            walls = (f"{wall:.1f}", f"{wall / pred:.2f}") if wall else ("-", "-")
            impl = row.get("impl") or row.get("arm")
            out.append(f"| {path.rsplit('/', 1)[-1]} | {shape} | {impl} | {meas:.1f} | "
                       f"{walls[0]} | {pred:.1f} | {meas / pred:.2f} | {walls[1]} |")  # fmt: skip
    return out


def main(argv=None) -> int:
    """Kernel rows of the matmul / decode benches beside the model; a ``bench_rollout`` JSON's
    decode step beside the rollout model (``gpu_rollout.validation_table``)."""
    from kernels_pallas.perf_model import gpu_rollout

    paths = list(argv if argv is not None else sys.argv[1:])
    rollouts = [p for p in paths if os.path.basename(p).startswith("bench_rollout")]
    print("\n".join(rows_beside([p for p in paths if p not in rollouts])))
    for path in rollouts:
        try:
            print("\n" + gpu_rollout.validation_table(path))
        except (OSError, ValueError) as e:  # a rollout stage cut before it wrote its rows
            print(f"\n({path}: not read: {type(e).__name__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
