"""Rollout decode throughput, W8A8 + FP8 KV against BF16, from the per-kernel predictions.

Issue 21's last target: a Qwen3-8B-shaped rollout with 4K-token responses at >= 1.4x the BF16
tokens/s. One decode step of ``B`` rows runs, per layer, the kernels the compiled programs
launch (``hlo_launches``: counted in the H100 decode loops, ``rollout_launches.json``):

  FP8 rollout (``fp8rl_jax.models.fused``): q|k|v as one GEMM, decode attention on the FP8
      cache, o_proj, gate+up as one GEMM, down_proj (``gpu.predict_matmul`` with x FP8;
      ``gpu_attention.predict_attention``), each GEMM's input quantized by its producer's kernel
      (``act_quantize.fused``: RMSNorm x2, the attention chunks' combine, SiLU product: the
      program's four Triton launches per layer, ``gpu.quantize_s`` each);
  BF16 rollout: q|k|v as one GEMM (XLA fuses the three dots: the count says so), o, gate, up
      and down as BF16 GEMMs (``gpu.bf16_gemm_s``), BF16-cache decode attention
      (``gpu_attention.bf16_attention_s``);

plus each program's own count of other XLA fusions per layer (QK-norm and RoPE, the cache write,
residual adds with the swap-AB GEMM outputs' transposes and split-K sums, which XLA fuses into their
consumers; in the BF16 program also the two RMSNorms, the SiLU product and the attention chunks'
combine, which FP8 runs as its producer kernels), at ``gpu.LAUNCH_S`` each: launch-bound at decode
sizes. Per step, for both: the BF16 LM head GEMM over the vocabulary and the step's other fusions
(sampling, stop checks). The context is the mean over a response: ``prompt + response / 2`` slots.
Prefill is left out (a 4K-token response is decode-bound: 4,096 launches of every kernel against one
prefill). tokens/s = B / step time. The table gives the KV cache at full length too: from B = 128
the BF16 cache (108 GiB) no longer fits one H100, the FP8 one (54 GiB) does, so there FP8's gain is
also the batch BF16 cannot hold (not counted). Predicted, never measured: the per-kernel assumptions
of ``gpu.py`` all carry over.

Both engines are predicted from their own counts: the static engine (``generate``) and the paged
engine (``generate_paged``, what the real-model recipes run: one slot per row here), whose loop
has, per decode step and for FP8 and BF16 alike, its own launches outside the model (the
predicate of its release / admission / page-growth bookkeeping, which runs under a ``lax.cond``
only when due, the slots' sampling state, loop-carried copies: ``hlo_launches
.paged_step_launches``; admission and prefill are left out as above). The attention kernel is the
paged one in both (the dense kernel's model is the same at these shapes:
``gpu_attention.predict_attention``). ``paged_bookkeeping_change`` gives the paged step before
-> after that cond.

Both programs also pay, per step, the predicates the host reads (``hlo_launches
.decode_body_syncs``, ``.paged_step_syncs``: the decode loop's; in the paged engine also its
bookkeeping and decode conds' branch indices), ``gpu.HOST_SYNC_S`` each, FP8 and BF16 alike.
"""

from __future__ import annotations

import dataclasses

from kernels_pallas.perf_model import gpu, gpu_attention, hlo_launches
from kernels_pallas.perf_model.sass_profiles import RESULTS_DIR


@dataclasses.dataclass(frozen=True)
class DenseModel:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int


QWEN3_8B = DenseModel("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936)
PROMPT, RESPONSE = 2048, 4096  # tokens (the 4K-token responses)
BATCHES = (16, 64, 128, 256)  # decode rows per GPU
ENGINES = hlo_launches.ENGINES  # ("static", "paged")


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    model: str
    chip: str
    batch: int
    context: int
    fp8_s: float
    bf16_s: float
    fp8_parts: dict  # kernel -> seconds per step (all layers)
    bf16_parts: dict

    kv_fp8_gib: float = 0.0  # the whole cache at full length (prompt + response), per GPU
    kv_bf16_gib: float = 0.0
    engine: str = "static"

    @property
    def ratio(self) -> float:
        return self.bf16_s / self.fp8_s

    def to_json(self) -> dict:
        return dict(dataclasses.asdict(self), ratio=self.ratio,
                    fp8_tokens_per_s=self.batch / self.fp8_s,
                    bf16_tokens_per_s=self.batch / self.bf16_s)  # fmt: skip


def launch_counts(precision: str, batch: int, engine: str,
            path: str = hlo_launches.LAUNCHES_JSON) -> hlo_launches.Launches:  # fmt: skip
    """The measured launches of the batch size measured nearest below ``batch`` (or above)."""
    by_b = hlo_launches.load(path, engine=engine)[precision]
    sizes = sorted(int(b) for b in by_b)
    return by_b[str(max([b for b in sizes if b <= batch] or sizes[:1]))]


def gemm_s(chip: str, batch: int, n: int, k: int, raw: bool, *, k_slices: bool = True,
           pdl: bool = True) -> float:  # fmt: skip
    """A decode GEMM inside the rollout program: x FP8 from its producer's kernel, or ``raw``
    (quantized in-kernel, ``act_quantize.quantizes_for``); today's tiles are the dispatch's,
    the tiles before a change (``k_slices`` / ``pdl`` False) the rules' with it undone."""
    from kernels_pallas.fp8_matmul import mgpu_config, tile_choice

    if k_slices and pdl:
        tile = tile_choice.dispatch_config(batch, n, k, fused=raw, chip=chip)
    else:
        tile = mgpu_config.default_config(batch, n, k, fused=raw, k_slices=k_slices, pdl=pdl)
    x = "bf16" if raw else "fp8"
    return gpu.predict_matmul(chip, batch, n, k, x, in_program=True, config=tile).time_s


def decode_step(chip: str, cfg: DenseModel, batch: int, context: int, engine: str = "static",
                attn_stages: int | None = None,
                k_slices: bool = True, pdl: bool = True) -> StepPrediction:  # fmt: skip
    """One decode step of ``batch`` rows at ``context`` slots on ``engine``, FP8 and BF16
    (module docstring); ``attn_stages``: the FP8 attention's ring depth (None: the default);
    ``k_slices=False``: the GEMMs' tiles of one 128-K slice per step (before the default took
    two: ``mgpu_config._DECODE_K_SLICES``); ``pdl=False``: the GEMMs and the attention kernel
    launched after their predecessor completes (before they launched dependent:
    ``kernels_pallas/dependent_launch``)."""

    d, c = cfg.hidden, cfg.head_dim
    q_n, kv_n = cfg.heads * c, cfg.kv_heads * c
    fp8_n, bf16_n = launch_counts("fp8", batch, engine), launch_counts("bf16", batch, engine)
    engine = "paged" if engine == hlo_launches.PAGED_BEFORE else engine
    # the kernels modelled one by one must be the ones the programs launch: the FP8 GEMMs'
    # inputs quantized by 4 Triton producers, or (``act_quantize.quantizes_for``: Hopper at 16
    # rows) by none, the GEMMs quantizing raw x in-kernel and the producers XLA fusions
    fp8_kinds = (fp8_n.per_layer["mosaic"], fp8_n.per_layer["triton"])
    assert fp8_kinds in ((5, 4), (5, 0)), fp8_n
    assert (bf16_n.per_layer["xla_gemm"], bf16_n.per_layer["mosaic"]) == (5, 1), bf16_n
    raw = fp8_kinds[1] == 0

    def mm(n, k):
        return gemm_s(chip, batch, n, k, raw, k_slices=k_slices, pdl=pdl)

    def quant(k):  # a producer + quantization kernel writing [batch, k] FP8
        return gpu.quantize_s(chip, batch, k)

    attn = gpu_attention.predict_attention(chip, "paged_attention", batch, context, cfg.heads,
                                 cfg.kv_heads, c, in_program=True, stages=attn_stages,
                                 pdl=pdl)  # fmt: skip
    fp8 = {
        "q|k|v fused": mm(q_n + 2 * kv_n, d),
        "attention (FP8 cache)": attn.time_s,
        "o_proj": mm(d, q_n),
        "gate+up fused": mm(2 * cfg.ffn, d),
        "down_proj": mm(d, cfg.ffn),
        "4 producer+quantize kernels": 0.0 if raw else 2 * quant(d) + quant(q_n) + quant(cfg.ffn),
        f"{fp8_n.per_layer['xla']} other fusions": fp8_n.per_layer["xla"] * gpu.LAUNCH_S,
    }
    bf = lambda n, k: gpu.bf16_gemm_s(chip, batch, n, k, fill=False)  # noqa: E731
    bf16 = {
        "q|k|v (XLA fuses the dots)": bf(q_n + 2 * kv_n, d),
        "attention (BF16 cache)": gpu_attention.bf16_attention_s(
            chip, batch, context, cfg.kv_heads, c
        ),
        "o_proj": bf(d, q_n),
        "gate, up": 2 * bf(cfg.ffn, d),
        "down_proj": bf(d, cfg.ffn),
        "(RMSNorm x2, combine, SiLU product: XLA fusions among the others)": 0.0,
        f"{bf16_n.per_layer['xla']} other fusions": bf16_n.per_layer["xla"] * gpu.LAUNCH_S,
    }
    return step(chip, cfg, batch, context, engine, (fp8, fp8_n), (bf16, bf16_n))


def step(chip: str, cfg: DenseModel, batch: int, context: int, engine: str,
         fp8: tuple, bf16: tuple) -> StepPrediction:  # fmt: skip
    """The step from each program's per-layer kernel times and its launch counts (``(parts,
    Launches)``): the layers, then per step the BF16 LM head GEMM, the step's other fusions and
    the host syncs; the KV cache at full length (FP8: one byte an element)."""
    head = gpu.bf16_gemm_s(chip, batch, cfg.vocab, cfg.hidden, fill=False)  # both

    def parts(per_layer: dict, n: hlo_launches.Launches) -> dict:
        return {k: v * cfg.layers for k, v in per_layer.items()} | {
            f"LM head + {n.per_step['xla']} fusions": head + n.per_step["xla"] * gpu.LAUNCH_S,
            f"{n.host_syncs} host syncs": n.host_syncs * gpu.HOST_SYNC_S,
        }

    fp8_parts, bf16_parts = parts(*fp8), parts(*bf16)
    kv = 2 * cfg.layers * batch * (PROMPT + RESPONSE) * cfg.kv_heads * cfg.head_dim / 2**30
    return StepPrediction(cfg.name, chip, batch, context, sum(fp8_parts.values()),
                          sum(bf16_parts.values()), fp8_parts, bf16_parts, kv, 2 * kv,
                          engine)  # fmt: skip


QWEN3_1P7B = DenseModel("Qwen3-1.7B", 28, 2048, 16, 8, 128, 6144, 151936)
BENCH_MODELS = {"qwen3-1.7b": QWEN3_1P7B, "qwen3-8b": QWEN3_8B}  # bench_rollout.py GPU models
# the first device run's rollout (bench_rollout.py on one H200: random weights, static engine)
MEASURED_ROLLOUT = "gpu_h200_2026-12-04/run1/bench_rollout.json"
# its FP8 attention's ring depth (the default then; later files record theirs in their meta)
MEASURED_ROLLOUT_ATTN_STAGES = 3


def validation(path: str | None = None) -> dict | None:
    """The model against a measured rollout (``bench_rollout.py``'s JSON; default: the first
    device run's, Qwen3-1.7B shape, B = 32, 1K prompt + 4K response on an H200): its decode
    step at the mean context (prompt + response / 2), raw (SASS model alone) and calibrated
    (``gpu.KERNEL_CALIBRATION``, from the kernel benchmarks only), beside the measured ms per
    step of the BF16 and the W8A8 + FP8 KV rows. None where the file lacks either row, or its
    model or device has no model here."""
    import json
    import os

    from kernels_pallas.perf_model import compare

    path = path or os.path.join(RESULTS_DIR, MEASURED_ROLLOUT)
    with open(path) as f:
        data = json.load(f)
    meta = data.get("meta", {})
    rows = {r["variant"]: r for r in data.get("rows", []) if r.get("ms_per_step")}
    cfg, chip = BENCH_MODELS.get(meta.get("model")), compare.chip_of(meta.get("device_kind", ""))
    if cfg is None or chip is None or not {"bf16", "w8a8_fp8kv"} <= set(rows):
        return None
    bf16, fp8 = rows["bf16"], rows["w8a8_fp8kv"]
    ctx = fp8["prompt_len"] + fp8["new_tokens"] // 2
    st = meta.get("fp8_attention_stages", MEASURED_ROLLOUT_ATTN_STAGES)
    # the GEMM tiles it ran: two-slice decode tiles where its meta says so (later runs)
    ran = dict(
        attn_stages=st,
        k_slices=bool(meta.get("decode_k_slices", False)),
        pdl=bool(meta.get("decode_pdl", False)),
    )  # and their launch
    with gpu.uncalibrated():
        raw = decode_step(chip, cfg, fp8["batch"], ctx, **ran)
    cal = decode_step(chip, cfg, fp8["batch"], ctx, **ran)
    now = decode_step(chip, cfg, fp8["batch"], ctx)
    return dict(measured_fp8_ms=fp8["ms_per_step"], measured_bf16_ms=bf16["ms_per_step"],
                measured_ratio=bf16["ms_per_step"] / fp8["ms_per_step"], raw=raw,
                calibrated=cal, now=now, label=f"{cfg.name} shape, {chip}, B = {fp8['batch']}, "
                f"context {ctx:,}")  # fmt: skip


def validation_table(path: str | None = None) -> str:
    v = validation(path)
    if v is None:
        return f"(no rollout the model can predict in {path})"
    rows = [f"| decode step, {v['label']} | FP8 (ms) | BF16 (ms) | BF16 / FP8 |",
            "|---|---|---|---|",
            f"| measured (bench_rollout.py) | {v['measured_fp8_ms']:.2f} "
            f"| {v['measured_bf16_ms']:.2f} | {v['measured_ratio']:.2f}x |"]  # fmt: skip
    names = {"raw": "model, SASS alone", "calibrated": "model, calibrated",
             "now": "model, calibrated, today's defaults (predicted)"}  # fmt: skip
    for name, title in names.items():
        p = v[name]
        rows.append(f"| {title} | {p.fp8_s * 1e3:.2f} | {p.bf16_s * 1e3:.2f} "
                    f"| {p.ratio:.2f}x |")  # fmt: skip
    return "\n".join(rows)


def paged_bookkeeping_change(chip: str = "h100") -> str:
    """Before -> after of the paged engine's step when release, admission and page growth went
    under a ``lax.cond`` (``generation.paged.engine.bookkeeping_due``): the launch counts of
    both compiled programs, the same kernel predictions."""
    ctx = PROMPT + RESPONSE // 2
    rows = ["| rows B | launches per step, FP8 before -> after | FP8 step (us) | BF16 step (us) "
            "| FP8 / BF16 ratio |", "|" + "---|" * 5]  # fmt: skip
    for b in BATCHES:
        old = decode_step(chip, QWEN3_8B, b, ctx, hlo_launches.PAGED_BEFORE)
        new = decode_step(chip, QWEN3_8B, b, ctx, "paged")
        n_old, n_new = (launch_counts("fp8", b, e).total(QWEN3_8B.layers)
                        for e in (hlo_launches.PAGED_BEFORE, "paged"))  # fmt: skip
        rows.append(f"| {b} | {n_old} -> {n_new} | {old.fp8_s * 1e6:.0f} -> {new.fp8_s * 1e6:.0f} "
                    f"| {old.bf16_s * 1e6:.0f} -> {new.bf16_s * 1e6:.0f} "
                    f"| {old.ratio:.2f} -> {new.ratio:.2f} |")  # fmt: skip
    return f"Paged engine, {QWEN3_8B.name}, {chip}, context {ctx}:\n\n" + "\n".join(rows)


def predictions(chips=gpu.GPU_CHIPS) -> list[StepPrediction]:
    ctx = PROMPT + RESPONSE // 2
    return [decode_step(chip, QWEN3_8B, b, ctx, e) for e in ENGINES for chip in chips
            for b in BATCHES]  # fmt: skip


def table(preds: list[StepPrediction]) -> str:
    rows = ["| model | engine | chip | rows B | mean context | FP8 step (us) | BF16 step (us) "
            "| FP8 tokens/s | BF16 tokens/s | ratio | KV cache GiB, FP8 / BF16 |",
            "|" + "---|" * 11]  # fmt: skip
    for p in preds:
        rows.append(f"| {p.model} | {p.engine} | {p.chip} | {p.batch} | {p.context} "
                    f"| {p.fp8_s * 1e6:.0f} "
                    f"| {p.bf16_s * 1e6:.0f} | {p.batch / p.fp8_s:,.0f} | "
                    f"{p.batch / p.bf16_s:,.0f} | {p.ratio:.2f}x | {p.kv_fp8_gib:.0f} / "
                    f"{p.kv_bf16_gib:.0f} |")  # fmt: skip
    return "\n".join(rows)


def breakdown(p: StepPrediction) -> str:
    """Per-kernel time of one step (all layers), FP8 beside BF16."""
    rows = [f"{p.model}, {p.engine} engine, {p.chip}, B = {p.batch}, context {p.context}: "
            "per step (us)",
            "", "| FP8 kernel | us | BF16 kernel | us |", "|---|---|---|---|"]  # fmt: skip
    for (a, ta), (b, tb) in zip(p.fp8_parts.items(), p.bf16_parts.items(), strict=True):
        rows.append(f"| {a} | {ta * 1e6:.0f} | {b} | {tb * 1e6:.0f} |")
    return "\n".join(rows)


def target(preds: list[StepPrediction]) -> str:
    """Judged at the batch sizes whose BF16 cache fits one H100 beside the 16 GiB of BF16
    weights (a bigger batch only FP8 can hold is a further gain this leaves out), on every
    engine."""
    h100 = [p for p in preds if p.chip == "h100" and p.kv_bf16_gib + 16 <= 80 * 0.9]
    met = [p for p in h100 if p.ratio >= 1.4]
    worst = min(h100, key=lambda p: p.ratio)
    engines = "/".join(dict.fromkeys(p.engine for p in h100))
    return (f"- W8A8 + FP8 KV rollout, Qwen3-8B shape, 4K-token responses, >= 1.4x BF16 tokens/s "
            f"(decode step, H100, {engines} engine, batches whose BF16 cache fits): "
            f"{'MET' if len(met) == len(h100) else 'NOT MET'} "
            f"({len(met)}/{len(h100)} cases meet it); worst {worst.engine} B={worst.batch}: "
            f"{worst.ratio:.2f}")  # fmt: skip
