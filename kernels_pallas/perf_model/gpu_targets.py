"""The GPU half's cases (``CASES``, ``predict_gpu``: the layers and attention shapes of issue 21),
its design changes (before -> after, predicted) and issue 21's H100 targets, judged on
``gpu.py``'s predictions (``python -m kernels_pallas.perf_model`` prints them)."""

from __future__ import annotations

import dataclasses

from kernels_pallas.fp8_matmul.mgpu_config import FUSED_DECODE_ROWS, NUM_SMS
from kernels_pallas.perf_model.common import GPU_CHIPS, Case, Prediction
from kernels_pallas.perf_model.gpu import hbm_ceiling, predict_matmul
from kernels_pallas.perf_model.gpu_attention import predict_attention

# --- the cases the GPU half predicts --------------------------------------------------------------

# (model, layer, N, K, token counts M): the issue-21 target shapes (Qwen3-8B, Llama-3-70B,
# DeepSeek-V3 as in DeepGEMM's table).
MATMUL_LAYERS = (
    ("Qwen3-8B", "q|o_proj", 4096, 4096, (16, 64, 128, 256, 4096)),
    ("Qwen3-8B", "k|v_proj", 1024, 4096, (16, 4096)),
    ("Qwen3-8B", "gate|up", 12288, 4096, (16, 4096)),
    ("Qwen3-8B", "down", 4096, 12288, (16, 4096)),
    ("Llama-3-70B", "q|o_proj", 8192, 8192, (16, 4096)),
    ("Llama-3-70B", "gate|up", 28672, 8192, (16, 64, 4096)),
    ("DeepSeek-V3", "N=24576 K=1536", 24576, 1536, (64, 4096)),
    ("DeepSeek-V3", "N=7168 K=16384", 7168, 16384, (64, 4096)),
)
# (model, layer, part widths N, K, token counts M): the projections the FP8 rollout runs as one
# GEMM over its parts' concatenated weights (``fp8rl_jax.models.fused``).
FUSED_LAYERS = (
    ("Qwen3-8B", "q|k|v fused", (4096, 1024, 1024), 4096, (16, 64, 4096)),
    ("Qwen3-8B", "gate+up fused", (12288, 12288), 4096, (16, 64, 4096)),
    ("Llama-3-70B", "q|k|v fused", (8192, 1024, 1024), 8192, (16, 64, 4096)),
    ("Llama-3-70B", "gate+up fused", (28672, 28672), 8192, (16, 64, 4096)),
)
# MATMUL_LAYERS rows the FP8 rollout no longer runs on their own (their fused row replaces them;
# q_proj shares its row with o_proj, which still runs alone).
SEPARATE_ONLY = (("Qwen3-8B", "k|v_proj"), ("Qwen3-8B", "gate|up"), ("Llama-3-70B", "gate|up"))
# (model, B, S, H, K kv heads); head_dim 128
ATTENTION_SHAPES = (
    ("Qwen3-8B", 1, 32768, 32, 8),
    ("Qwen3-8B", 8, 32768, 32, 8),
    ("Qwen3-8B", 32, 32768, 32, 8),
    ("Qwen3-8B", 256, 4096, 32, 8),
    ("Llama-3-70B", 16, 32768, 64, 8),
)


def _cases() -> list[Case]:
    out = []
    for model, layer, n, k, ms in MATMUL_LAYERS:
        for m in ms:
            label = f"{model} {layer} M={m}"
            out.append(Case.make("fp8_matmul", label, GPU_CHIPS, M=m, N=n, K=k, x="bf16"))
    for model, layer, parts, k, ms in FUSED_LAYERS:
        for m in ms:
            label = f"{model} {layer} M={m}"
            out.append(Case.make("fp8_matmul", label, GPU_CHIPS, M=m, N=sum(parts), K=k, x="bf16"))
    for op in ("decode_attention", "paged_attention"):
        for model, b, s, h, n_kv in ATTENTION_SHAPES:
            label = f"{model} B={b} S={s} H/K={h}/{n_kv} fp8 cache"
            dims = dict(B=b, S=s, H=h, KV=n_kv, D=128, cache="fp8")
            out.append(Case.make(op, label, GPU_CHIPS, **dims))
    return out


CASES: list[Case] = _cases()


def predict_gpu(op: str, shape: dict, chip: str, label: str = "") -> Prediction:
    """The common interface: ``op`` at ``shape`` (``common`` names the dims) on ``chip``."""
    if op == "fp8_matmul":
        return predict_matmul(chip, shape["M"], shape["N"], shape["K"], shape.get("x", "bf16"),
                              label=label)  # fmt: skip
    if op in ("decode_attention", "paged_attention"):
        return predict_attention(chip, op, shape["B"], shape["S"], shape["H"], shape["KV"],
                                 shape["D"], shape.get("cache", "fp8"), label=label)  # fmt: skip
    raise ValueError(f"perf_model.gpu: no model for {op}")


def _standalone_and_in_program(chip, m, n, k, label, cfg_before, cfg_after):
    """(before, after) at two configs: a standalone call with BF16 x quantized once (its
    quantize and epilogue launches), and the GEMM in the program with x FP8 from its
    producer."""
    for in_program, x, where in ((False, "bf16", ""), (True, "fp8", ", in program")):
        yield tuple(
            predict_matmul(chip, m, n, k, x, label=label + where, config=cfg,
                           in_program=in_program, mode="qarray" if x == "bf16" else "default")
            for cfg in (cfg_before, cfg_after)
        )  # fmt: skip


def _decode_change(change: str, configs) -> list[tuple[str, Prediction, Prediction]]:
    """``change``'s rows (standalone and in a program, each chip) at every decode shape (M <=
    256) whose tiles ``configs(m, n, k)`` -> (before, after) differ."""
    out = []
    for model, layer, n, k, ms in (*MATMUL_LAYERS, *DECODE_ROWS_LAYERS):
        for m in (m for m in ms if m <= 256):
            was, now = configs(m, n, k)
            if now == was:
                continue
            for chip in GPU_CHIPS:
                pairs = _standalone_and_in_program(chip, m, n, k, f"{model} {layer} M={m}",
                                                   was, now)  # fmt: skip
                out += [(change, b, a) for b, a in pairs]
    return out


def design_changes() -> list[tuple[str, Prediction, Prediction]]:
    """(change, before, after) at every case the change touches, on H100 and H200."""
    from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu

    out = []
    for model, layer, n, k, ms in MATMUL_LAYERS:
        for m in (m for m in ms if m > 64):
            for chip in GPU_CHIPS:
                label = f"{model} {layer} M={m}"
                before = predict_matmul(chip, m, n, k, "bf16", mode="fused", label=label)
                after = predict_matmul(chip, m, n, k, "bf16", mode="qarray", label=label)
                out.append(("x quantized once (QArray kernel for every M)", before, after))
    for model, layer, n, k, ms in MATMUL_LAYERS:
        for m in (m for m in ms if m > 256):
            for chip in GPU_CHIPS:
                label = f"{model} {layer} M={m}"
                before = predict_matmul(chip, m, n, k, "bf16", label=label, quant="xla")
                after = predict_matmul(chip, m, n, k, "bf16", label=label)
                out.append(("x quantized by act_quantize at every M (one read of x)", before,
                            after))  # fmt: skip
    for model, layer, n, k, ms in MATMUL_LAYERS:
        for m in (m for m in ms if m <= 64):
            for chip in GPU_CHIPS:
                label = f"{model} {layer} M={m}"
                one = mgpu.default_config(m, n, k, k_slices=False, pdl=False)  # the tiles of then
                after = predict_matmul(chip, m, n, k, "bf16", label=label, config=one,
                                       mode="qarray")  # fmt: skip
                before = predict_matmul(chip, m, n, k, "bf16", label=label, split_k=1,
                                        config=one, mode="qarray")  # fmt: skip
                if before.impl != after.impl:
                    out.append(("decode GEMM: split-K to fill the SMs", before, after))
    for model, layer, n, k, ms in (*MATMUL_LAYERS, *DECODE_ROWS_LAYERS):
        for m in (m for m in ms if 64 < m <= 256):
            for chip in GPU_CHIPS:
                pairs = _standalone_and_in_program(
                    chip, m, n, k, f"{model} {layer} M={m}",
                    mgpu.default_config(m, n, k, swap=False),
                    mgpu.default_config(m, n, k, k_slices=False, pdl=False),
                )  # fmt: skip
                change = "decode GEMM: swap-AB up to 128 rows (65-256-row batches)"
                out += [(change, b, a) for b, a in pairs if b.impl != a.impl]
    for model, layer, n, k, ms in (*MATMUL_LAYERS, *DECODE_ROWS_LAYERS):
        for m in (m for m in ms if m <= 256):
            now = mgpu.default_config(m, n, k, k_slices=False, pdl=False)
            if not now.cluster_k:
                continue
            for chip in GPU_CHIPS:
                pairs = _standalone_and_in_program(
                    chip, m, n, k, f"{model} {layer} M={m}",
                    dataclasses.replace(now, cluster_k=False), now,
                )  # fmt: skip
                change = "decode GEMM: 2 K chunks summed in their CTA cluster (DSMEM)"
                out += [(change, b, a) for b, a in pairs]
    out += _decode_change(
        "decode GEMM: two 128-K slices per pipeline step (bytes in flight x2)",
        lambda m, n, k: [mgpu.default_config(m, n, k, k_slices=s, pdl=False)
                         for s in (False, True)],
    )  # fmt: skip
    out += _decode_change(
        "decode GEMM: dependent launch (PDL), first ring's weights to L2",
        lambda m, n, k: [mgpu.default_config(m, n, k, pdl=d) for d in (False, True)],
    )
    for model, layer, n, k, ms in (*MATMUL_LAYERS, *DECODE_ROWS_LAYERS):
        for m in (m for m in ms if m == FUSED_DECODE_ROWS):
            for chip in GPU_CHIPS:  # standalone: x BF16 (in the program it arrives FP8)
                label = f"{model} {layer} M={m}"
                before, after = (predict_matmul(chip, m, n, k, "bf16", label=label, mode=mode)
                                 for mode in ("qarray", "default"))  # fmt: skip
                out.append(("decode GEMM: BF16 x quantized in-kernel (M = 16, no act_quantize "
                            "launch)", before, after))  # fmt: skip
    out += _fused_pick_changes()
    out += _model_pick_changes()
    for model, layer, n, k, m in WAVE_ROWS:
        tiles_m = -(-m // 128)  # before: 128x128, clustered by default_config's unchanged rule
        cl = 2 if tiles_m % 2 == 0 and tiles_m * n // 128 >= NUM_SMS * 2 // 3 else 1
        for chip in GPU_CHIPS:
            label = f"{model} {layer} M={m}"
            before, after = (
                predict_matmul(chip, m, n, k, "fp8", label=label, config=cfg, in_program=True)
                for cfg in (mgpu.MgpuConfig(128, 128, 4, cluster_m=cl),
                            mgpu.default_config(m, n, k, overlap=False))
            )  # fmt: skip
            out.append(("prefill: 128x256 where 128x128 needs a second wave", before, after))
    for model, layer, n, k, ms in MATMUL_LAYERS:
        for m in (m for m in ms if m > 64):
            for chip in GPU_CHIPS:
                label = f"{model} {layer} M={m}"
                was = mgpu.default_config(m, n, k, swap=False, overlap=False)
                steps = (
                    ("prefill: 128x256 CTA tiles (2 sub-tiles per warpgroup)",
                     mgpu.MgpuConfig(128, 128, 4), dataclasses.replace(was, cluster_m=1)),
                    ("prefill: 2-CTA clusters along M, weight tile multicast",
                     dataclasses.replace(was, cluster_m=1), was),
                    ("prefill: persistent grid, snake tile order",
                     was, dataclasses.replace(was, persistent=NUM_SMS)),
                    ("prefill: promotions under the wgmmas (128x128, two 128-K slices a step)",
                     was, mgpu.default_config(m, n, k, swap=False)),
                )  # fmt: skip
                for change, cfg_before, cfg_after in steps:
                    before, after = (
                        predict_matmul(chip, m, n, k, "bf16", mode="qarray", label=label,
                                       config=c)
                        for c in (cfg_before, cfg_after)
                    )  # fmt: skip
                    if before.impl != after.impl:
                        out.append((change, before, after))
    for model, layer, parts, k, ms in FUSED_LAYERS:
        for m in ms:
            for chip in GPU_CHIPS:
                label = f"{model} {layer} M={m}"
                fused = predict_matmul(chip, m, sum(parts), k, "bf16", label=label)
                out.append(("q|k|v and gate+up: one GEMM over the concatenated weights",
                            separate_sum(chip, m, parts, k, label), fused))  # fmt: skip
    for model, b, s, h, n_kv in ATTENTION_SHAPES:
        for chip in GPU_CHIPS:
            label = f"{model} B={b} S={s} H/K={h}/{n_kv} fp8 cache"
            before = predict_attention(chip, "paged_attention", b, s, h, n_kv, 128, splits=1,
                                       label=label)  # fmt: skip
            after = predict_attention(chip, "paged_attention", b, s, h, n_kv, 128, label=label)
            if before.impl != after.impl:
                out.append(("paged attention: splits for every batch size", before, after))
    for op in ("decode_attention", "paged_attention"):
        for model, b, s, h, n_kv in ATTENTION_SHAPES:
            for chip in GPU_CHIPS:
                label = f"{model} B={b} S={s} H/K={h}/{n_kv} fp8 cache"
                before, after = (
                    predict_attention(chip, op, b, s, h, n_kv, 128, label=label, swap_ab=swap)
                    for swap in (False, True)
                )
                change = "decode attention: swap-AB (the query group as wgmma N)"
                out.append((change, before, after))
    for op in ("decode_attention", "paged_attention"):  # the FP8 ring: 3 stages -> 5
        for model, b, s, h, n_kv in ATTENTION_SHAPES:
            for chip in GPU_CHIPS:
                label = f"{model} B={b} S={s} H/K={h}/{n_kv} fp8 cache"
                before, after = (predict_attention(chip, op, b, s, h, n_kv, 128, label=label,
                                                   stages=st) for st in (3, None))  # fmt: skip
                out.append(("decode attention: a 5-stage FP8 ring (was 3)", before, after))
    for model, b, s, h, n_kv in ATTENTION_SHAPES:  # a candidate the autotuner times, not a default
        for chip in GPU_CHIPS:
            label = f"{model} B={b} S={s} H/K={h}/{n_kv} fp8 cache"
            before, wide = (
                predict_attention(chip, "decode_attention", b, s, h, n_kv, 128, label=label, **kw)
                for kw in ({}, {"block_s": 128})
            )
            change = "decode attention, autotuner candidate: 128-slot FP8 tiles (1 CTA per SM)"
            out.append((change, before, wide))
    return out


# Decode batches of 65-256 rows at the narrow projections that ``MATMUL_LAYERS`` lists at 16
# and 4096 rows only: (model, layer, N, K, token counts M).
DECODE_ROWS_LAYERS = (
    ("Qwen3-8B", "k|v_proj", 1024, 4096, (128, 256)),
    ("Qwen3-8B", "down", 4096, 12288, (128, 256)),
    ("Qwen3-30B-A3B", "o_proj", 2048, 4096, (128, 256)),
    ("DeepSeek-V3", "N=7168 K=16384", 7168, 16384, (128,)),
)


# Rollout GEMM shapes at the batch sizes between decode and prefill where the dispatch's model
# picks the tile (``fp8_matmul.tile_choice``): (model, layer, N, K); at ``PICK_ROWS`` rows each.
PICK_LAYERS = (
    ("Qwen3-8B", "q|o_proj", 4096, 4096),
    ("Qwen3-8B", "k|v_proj", 1024, 4096),
    ("Qwen3-8B", "q|k|v fused", 6144, 4096),
    ("Qwen3-8B", "gate+up fused", 24576, 4096),
    ("Qwen3-8B", "down", 4096, 12288),
    ("Qwen3-30B-A3B", "o_proj", 2048, 4096),
    ("Llama-3-70B", "q|o_proj", 8192, 8192),
    ("Llama-3-70B", "k|v_proj", 1024, 8192),
    ("Llama-3-70B", "down", 8192, 28672),
    ("DeepSeek-V3", "N=7168 K=16384", 7168, 16384),
)
PICK_ROWS = (64, 96, 128, 256, 384, 1024)
PICK_CHANGE = "GEMM tile: the performance model's fastest where it beats the rules' (dispatch)"


def _model_pick_changes() -> list[tuple[str, Prediction, Prediction]]:
    """The rules' tile -> the dispatch's (the model's fastest candidate where it clearly beats
    the rules'), standalone and in a program, where they differ."""
    from kernels_pallas.fp8_matmul import mgpu_config, tile_choice

    out = []
    for model, layer, n, k in PICK_LAYERS:
        for m in PICK_ROWS:
            for chip in GPU_CHIPS:
                rule = mgpu_config.default_config(m, n, k)
                pick = tile_choice.dispatch_config(m, n, k, chip=chip)
                if pick != rule:
                    pairs = _standalone_and_in_program(chip, m, n, k, f"{model} {layer} M={m}",
                                                       rule, pick)  # fmt: skip
                    out += [(PICK_CHANGE, b, a) for b, a in pairs]
    return out


FUSED_PICK_ROWS = (32, 48, 64)
FUSED_PICK_CHANGE = "decode GEMM: BF16 x quantized in-kernel at 17-64 rows where the model picks it"


def _fused_pick_changes() -> list[tuple[str, Prediction, Prediction]]:
    """Raw BF16 x at 17-64 rows: quantized once (``act_quantize``, then the FP8-x tile) ->
    the fused kernel, where ``tile_choice.fused_wins`` takes it (standalone: in the rollout
    program x arrives FP8 from its producer's kernel)."""
    from kernels_pallas.fp8_matmul import tile_choice

    out = []
    for model, layer, n, k in PICK_LAYERS:
        for m in FUSED_PICK_ROWS:
            for chip in GPU_CHIPS:
                if tile_choice.fused_wins(m, n, k, chip=chip):
                    label = f"{model} {layer} M={m}"
                    before, after = (predict_matmul(chip, m, n, k, "bf16", label=label,
                                                    mode=mode)
                                     for mode in ("qarray", "fused"))  # fmt: skip
                    out.append((FUSED_PICK_CHANGE, before, after))
    return out


# Prefill grids where 128x128 CTAs need a second wave (one CTA per SM) and 128x256 do not
# (``mgpu_config._wide_grid``): (model, layer, N, K, M), FP8 x in the program.
WAVE_ROWS = (
    ("Qwen3-8B", "q|k|v fused", 6144, 4096, 384),
    ("Llama-3-70B", "q|k|v fused", 10240, 8192, 192),
    ("DeepSeek-V3", "N=7168 K=16384", 7168, 16384, 384),
)


def separate_sum(chip: str, m: int, parts, k: int, label: str) -> Prediction:
    """The parts of a fused projection as separate GEMMs (each quantizing x again): their
    predicted times summed, beside their BF16 GEMMs' times summed."""
    preds = [predict_matmul(chip, m, n, k, "bf16", label=label) for n in parts]
    impls = " + ".join(f"N={n}" for n in parts)
    return dataclasses.replace(
        preds[0], impl=f"{len(parts)} GEMMs ({impls})",
        time_s=sum(p.time_s for p in preds), baseline_s=sum(p.baseline_s for p in preds),
        bytes=sum(p.bytes for p in preds), flops=sum(p.flops for p in preds),
    )  # fmt: skip


def _runs_alone(label: str) -> bool:
    """Whether the FP8 rollout runs this MATMUL_LAYERS / FUSED_LAYERS row as its own GEMM."""
    return not any(label.startswith(f"{model} {layer} ") for model, layer in SEPARATE_ONLY)


def targets(preds: list[Prediction]) -> list[str]:
    """Issue 21's GPU targets, each judged on the model's predictions (H100)."""
    h100 = [p for p in preds if p.chip == "h100"]
    every = [p for p in h100 if p.op == "fp8_matmul"]
    mm = [p for p in every if _runs_alone(p.label)]  # the GEMMs the FP8 rollout runs
    big = [p for p in mm if p.label.endswith("M=4096")]
    small = [p for p in mm if int(p.label.rsplit("M=", 1)[1]) <= 64]
    small_all = [p for p in every if int(p.label.rsplit("M=", 1)[1]) <= 64]
    big_all = [p for p in every if p.label.endswith("M=4096")]
    att = [p for p in h100 if p.op in ("decode_attention", "paged_attention")]
    att64 = [p for p in att if _bkv(p.label) >= 64]

    def verdict(name, rows, ok, show, ceiling=None):
        met = [p for p in rows if ok(p)]
        worst = min(rows, key=show) if rows else None
        w = f"; worst {worst.label} ({worst.op}): {show(worst):.2f}" if worst else ""
        if ceiling and worst and len(met) < len(rows):  # ``ceiling``: the target ratio
            missed = [p for p in rows if not ok(p)]
            below = sum(hbm_ceiling(p) < ceiling for p in missed)
            w += f" (its ceiling {hbm_ceiling(worst):.2f}; {below} of the {len(missed)} missed " \
                 f"have a ceiling below {ceiling})"  # fmt: skip
        return f"- {name}: {'MET' if len(met) == len(rows) else 'NOT MET'} " \
               f"({len(met)}/{len(rows)} shapes meet it){w}"  # fmt: skip

    # x already FP8 (its quantization fused into the producer: no separate XLA fusion to launch)
    rows = [*MATMUL_LAYERS, *((mo, la, sum(parts), k, ms) for mo, la, parts, k, ms in FUSED_LAYERS)]
    pre = [predict_matmul("h100", m, n, k, "fp8", label=f"{model} {layer} M={m}")
           for model, layer, n, k, ms in rows for m in ms]  # fmt: skip
    pre = [p for p in pre if _runs_alone(p.label)]
    big_pre = [p for p in pre if p.label.endswith("M=4096")]
    small_pre = [p for p in pre if int(p.label.rsplit("M=", 1)[1]) <= 64]
    # inside the rollout program: x arrives FP8 from its producer's kernel (RMSNorm, the
    # attention combine, the SiLU product: ``act_quantize.fused``, launches the BF16 program
    # runs as XLA fusions), raw at the fused decode kernel's rows (``quantizes_for``: the
    # producer is then XLA's fusion), and a split-K sum fuses into its consumer (``gpu_rollout``)
    prog = [predict_matmul("h100", m, n, k, "bf16" if m == FUSED_DECODE_ROWS else "fp8",
                           label=f"{model} {layer} M={m}", in_program=True)
            for model, layer, n, k, ms in rows for m in ms if m <= 64]  # fmt: skip
    prog = [p for p in prog if _runs_alone(p.label)]
    return [
        "GEMMs the FP8 rollout runs: q|k|v and gate+up fused (one GEMM each, its BF16 baseline "
        "the BF16 GEMM of the same fused shape), o_proj, down_proj; the separate k|v_proj and "
        "gate|up rows are judged on their own in the 'every listed shape' lines. A missed "
        "M <= 64 line names the ceilings of its missed shapes (``hbm_ceiling``: BF16 over the "
        "FP8 kernel alone at its HBM bound, with its fixed cost and launch): where one is below "
        "the target, no tile, split or in-kernel quantization reaches it under the model's "
        "constants.",
        verdict("H100 fp8_matmul >= 1.5x BF16 jnp.dot at M = 4096 (BF16 x, quantization "
                "included)", big, lambda p: p.ratio >= 1.5, lambda p: p.ratio),
        verdict("  every listed shape, separate k|v_proj and gate|up included", big_all,
                lambda p: p.ratio >= 1.5, lambda p: p.ratio),
        verdict("  same, x arriving FP8 (quantization fused into its producer)", big_pre,
                lambda p: p.ratio >= 1.5, lambda p: p.ratio),
        verdict("H100 fp8_matmul >= 1.6x BF16 at M <= 64 (BF16 x; standalone: quantize, "
                "GEMM, output fusion)", small,
                lambda p: p.ratio >= 1.6, lambda p: p.ratio, ceiling=1.6),
        verdict("  every listed shape, separate k|v_proj and gate|up included", small_all,
                lambda p: p.ratio >= 1.6, lambda p: p.ratio, ceiling=1.6),
        verdict("  same, x arriving FP8", small_pre, lambda p: p.ratio >= 1.6,
                lambda p: p.ratio, ceiling=1.6),
        verdict("  same, in the rollout program (x quantized by its producer's kernel, at 16 "
                "rows in-kernel; split-K sums fused into their consumers)",
                prog, lambda p: p.ratio >= 1.6, lambda p: p.ratio, ceiling=1.6),
        verdict("H100 decode attention >= 80% of HBM, FP8 cache, B x KV >= 64", att64,
                lambda p: p.hbm_fraction() >= 0.8, lambda p: p.hbm_fraction()),
    ]  # fmt: skip


def _bkv(label: str) -> int:
    b = int(label.split("B=", 1)[1].split()[0])
    kv = int(label.split("H/K=", 1)[1].split()[0].split("/")[1])
    return b * kv
