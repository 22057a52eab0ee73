"""Rollout decode step of an MoE model, W8A8 + FP8 KV against BF16: ``gpu_rollout``'s method on
the Qwen3-30B-A3B programs' own launch counts (``hlo_launches --model qwen3-30b-a3b``, compiled
for H100 at 1 and 2 layers of its widths), on the static engine and on the paged one the
real-model recipes run (its bookkeeping's own launches and host syncs counted as for Qwen3-8B).

Per layer the FP8 program launches (the count checks it) 5 Mosaic GPU kernels: q|k|v as one GEMM
and o_proj (``gpu.predict_matmul``, x FP8 from its producer), decode attention on the FP8 cache,
and the experts' gate+up as one grouped GEMM over both stacks and down
(``gpu_grouped.predict_grouped_fp8``, B x top-k rows spread evenly over the experts); 2 Triton
kernels, the RMSNorm and attention-combine producers quantizing for q|k|v and o_proj
(``gpu.quantize_s``; none at 16 rows, where those GEMMs quantize raw x in-kernel); and the
router as an XLA BF16 GEMM. The BF16 program: q|k|v (XLA fuses the dots), o_proj and the router
as XLA GEMMs, attention on the BF16 cache, and gate, up and down each through
``grouped_matmul``'s BF16 kernel (``predict_grouped_bf16``: 128x256 tiles of two warpgroups
storing rows into y). Both: every other fusion at ``gpu.LAUNCH_S`` (routing: top-k and its
softmax, the sort by expert, the tile maps, the weighted combine; in the FP8 program also the
experts' row gathers from their swap-AB tiles, input quantization and SiLU product), then the
LM head, the step's fusions and its host syncs (``gpu_rollout.step``). Predicted, never
measured; ``gpu.py``'s assumptions carry over. The routing's sort is counted as XLA compiles it
without a device (its fallback sort; with a GPU present XLA takes CUB's, whose launches may
differ).
"""

from __future__ import annotations

import dataclasses

from kernels_pallas.perf_model import gpu, gpu_attention, gpu_grouped, hlo_launches
from kernels_pallas.perf_model.gpu_rollout import (
    PROMPT,
    RESPONSE,
    DenseModel,
    gemm_s,
    launch_counts,
    step,
)

MODEL = "qwen3-30b-a3b"  # the presets name its launch counts are kept under
BATCHES = (16, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class MoeModel(DenseModel):
    experts: int
    top_k: int
    expert_ffn: int


QWEN3_30B_A3B = MoeModel("Qwen3-30B-A3B", 48, 2048, 32, 4, 128, 6144, 151936, 128, 8, 768)


def moe_step(chip: str, cfg: MoeModel, batch: int, context: int, engine: str = "static"):
    """One decode step of ``batch`` rows at ``context`` slots on ``engine``, FP8 and BF16."""
    path = hlo_launches.launches_json(MODEL)
    fp8_n, bf16_n = (launch_counts(p, batch, engine, path) for p in ("fp8", "bf16"))
    # the kernels modelled one by one must be the ones the programs launch (no Triton producer
    # at 16 rows: the GEMMs take raw x, ``act_quantize.quantizes_for``)
    fp8_kinds = (fp8_n.per_layer["mosaic"], fp8_n.per_layer["triton"], fp8_n.per_layer["xla_gemm"])
    assert fp8_kinds in ((5, 2, 1), (5, 0, 1)), fp8_n
    raw = fp8_kinds[1] == 0
    assert (bf16_n.per_layer["mosaic"], bf16_n.per_layer["xla_gemm"]) == (4, 3), bf16_n
    d, c, e, f = cfg.hidden, cfg.head_dim, cfg.experts, cfg.expert_ffn
    q_n, kv_n, rows = cfg.heads * c, cfg.kv_heads * c, batch * cfg.top_k

    def mm(n, k):
        return gemm_s(chip, batch, n, k, raw)

    def experts_fp8(k, ns):
        return gpu_grouped.predict_grouped_fp8(chip, rows, e, k, ns, in_program=True).time_s

    def experts_bf16(k, n):
        p = gpu_grouped.predict_grouped_bf16(chip, rows, rows, e, k, n, "fwd", in_program=True)
        return p.time_s

    bf = lambda n, k: gpu.bf16_gemm_s(chip, batch, n, k, fill=False)  # noqa: E731
    attn = gpu_attention.predict_attention(chip, "paged_attention", batch, context, cfg.heads,
                                           cfg.kv_heads, c, in_program=True)  # fmt: skip
    fp8 = {
        "q|k|v fused": mm(q_n + 2 * kv_n, d),
        "attention (FP8 cache)": attn.time_s,
        "o_proj": mm(d, q_n),
        "router (XLA BF16 GEMM)": bf(e, d),
        "experts gate+up (grouped FP8, one launch)": experts_fp8(d, (f, f)),
        "experts down (grouped FP8)": experts_fp8(f, (d,)),
        "2 producer+quantize kernels": 0.0
        if raw
        else gpu.quantize_s(chip, batch, d) + gpu.quantize_s(chip, batch, q_n),
        f"{fp8_n.per_layer['xla']} other fusions": fp8_n.per_layer["xla"] * gpu.LAUNCH_S,
    }
    bf16 = {
        "q|k|v (XLA fuses the dots)": bf(q_n + 2 * kv_n, d),
        "attention (BF16 cache)": gpu_attention.bf16_attention_s(
            chip, batch, context, cfg.kv_heads, c
        ),  # fmt: skip
        "o_proj": bf(d, q_n),
        "router (XLA BF16 GEMM)": bf(e, d),
        "experts gate, up (grouped BF16 kernel, two launches)": 2 * experts_bf16(d, f),
        "experts down (grouped BF16 kernel)": experts_bf16(f, d),
        "(RMSNorm, combine: XLA fusions among the others)": 0.0,
        f"{bf16_n.per_layer['xla']} other fusions": bf16_n.per_layer["xla"] * gpu.LAUNCH_S,
    }
    return step(chip, cfg, batch, context, engine, (fp8, fp8_n), (bf16, bf16_n))


def predictions(chips=gpu.GPU_CHIPS) -> list:
    ctx = PROMPT + RESPONSE // 2
    return [moe_step(chip, QWEN3_30B_A3B, b, ctx, e) for e in hlo_launches.ENGINES
            for chip in chips for b in BATCHES]  # fmt: skip
