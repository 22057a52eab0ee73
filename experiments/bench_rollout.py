"""Benchmark rollout throughput: BF16 vs FP8 W8A8 vs W8A8 + FP8 KV cache, in the same run.

Each variant is the RL step's rollout as it runs (``generation.rollout``: cast -> quantize, the
per-step weight sync -> ``generate``: prefill + ``while_loop`` decode), jitted and compiled ahead
of the clock, on one model with random weights (``init_weights`` at the model's real config):
  * ``bf16``: BF16 weights, BF16 KV cache;
  * ``w8a8``: blockwise FP8 W8A8 linear layers (``QuantRecipe()``), BF16 KV cache;
  * ``w8a8_fp8kv``: W8A8 + an E4M3 KV cache with static per-layer scales, calibrated from the
    BF16 variant's prefill (the step-0 calibration pass of DESIGN.md §4.5).
Kernels: ``matmul_impl`` and ``decode_attention_impl`` ``auto`` for every variant (the Hopper
kernels on H100/H200, the XLA paths elsewhere); any fallback ``auto`` takes is logged in the
JSON (``fallbacks``). No stop tokens: every row generates the full budget (checked).

Timing: ``e2e_s`` is the whole jitted rollout (median of ``--reps`` calls after ``--warmup``);
``prefill_s`` a second program with the same weight sync and the prompt prefill alone
(``forward`` over the prompts into the cache); the decode loop takes ``e2e_s - prefill_s`` for
B · (A - 1) tokens. Reported: end-to-end tokens/s (B · A / e2e_s), decode tokens/s, ms per decode
step, and speedups over ``bf16`` (issue 11's target: ``w8a8_fp8kv`` >= 1.4x BF16 tokens/s).

Models: ``qwen3-1.7b`` (28 layers, D 2048, 16/8 heads of 128, F 6144, vocab 151936: the GPU
default, 1K-token prompts, 4K-token responses, batch 32), ``qwen3-8b`` (36 layers, D 4096, 32/8
heads, F 12288: issue 21's rollout target shape, batch 64: 16 GB of BF16 weights and 24-48 GB
of cache on an H200; ``--model qwen3-8b``), ``tiny`` (``--quick``: the code paths on
CPU in seconds), ``llama-small`` (CPU default). On CPU FP8 is emulated (dequantize, then dot):
the numbers say nothing about FP8 speed. ``--hf`` adds our generate vs ``transformers`` generate
(f32, CPU; needs ``.hfvenv``) at batch 1 and 16 on ``llama-small``.

Usage: ``python experiments/bench_rollout.py --quick`` (CPU, seconds); on a GPU without flags
(3 variants: 6 compiled programs and ~4K decode steps each); ``--out PATH.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import bench_common as bc  # noqa: E402
from fp8rl_jax.generation import (  # noqa: E402
    Prompts,
    RolloutConfig,
    SamplingConfig,
    calibrate_kv_scales,
    generate,
    prompt_segment_ids,
    rollout,
    rollout_weights,
)
from fp8rl_jax.generation.kv import init_cache  # noqa: E402
from fp8rl_jax.models import (  # noqa: E402
    ModelConfig,
    forward,
    init_weights,
    save_hf_checkpoint,
)
from fp8rl_jax.models.presets import QWEN3_1P7B, QWEN3_8B  # noqa: E402
from fp8rl_jax.quant import QuantRecipe  # noqa: E402
from fp8rl_jax.rl import calibrate_program  # noqa: E402

MODELS = {
    "qwen3-1.7b": QWEN3_1P7B,
    "qwen3-8b": QWEN3_8B,  # issue 21's rollout target shape (``--model qwen3-8b`` on a GPU)
    "tiny": ModelConfig(
        vocab_size=256, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=True,
        qk_norm=True, architecture="Qwen3ForCausalLM",
    ),
    "llama-small": ModelConfig(
        vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=64, intermediate_size=512, max_position_embeddings=1024,
    ),
}  # fmt: skip
# (batch, prompt tokens, response tokens) per model
SHAPES = {"qwen3-1.7b": (32, 1024, 4096), "qwen3-8b": (64, 1024, 4096), "tiny": (2, 16, 8),
          "llama-small": (16, 32, 64)}  # fmt: skip
_KV8 = dict(kv_cache_dtype="float8_e4m3fn")
VARIANTS = {  # name -> RolloutConfig fields; the first is the baseline
    "bf16": dict(quant=None),
    "w8a8_fp8kv": dict(quant=QuantRecipe(), **_KV8, kv_scale_mode="static"),
    "w8a8": dict(quant=QuantRecipe()),
    "w8a8_fp8kv_dynamic": dict(quant=QuantRecipe(), **_KV8, kv_scale_mode="dynamic"),
    "bf16_jnp_attention": dict(quant=None, decode_attention_impl=None),
}
DEFAULT_VARIANTS = ("bf16", "w8a8_fp8kv", "w8a8")  # the target's pair first


class _Fallbacks(logging.Handler):
    """Collects the one-line fallback messages of ``kernels_pallas.backend``."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def rollout_config(name: str, new_tokens: int) -> RolloutConfig:
    fields = dict(matmul_impl="auto", decode_attention_impl="auto") | VARIANTS[name]
    return RolloutConfig(
        sampling=SamplingConfig(temperature=1.0), max_new_tokens=new_tokens, stop_token_ids=(),
        **fields,
    )  # fmt: skip


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> Prompts:
    """Full-length random prompts (no padding): every row is ``prompt_len`` real tokens."""
    ids = np.random.default_rng(seed).integers(1, vocab, (batch, prompt_len), dtype=np.int32)
    return Prompts(jnp.asarray(ids), jnp.full((batch,), prompt_len, jnp.int32))


def prefill_fn(model_cfg: ModelConfig, cfg: RolloutConfig):
    """(params, prompts, kv_scales) -> (last logits, cache, Q/K/V amax): the weight sync and the
    prefill of the rollout, without the decode loop."""

    def prefill(params, prompts, kv_scales):
        weights, _ = rollout_weights(params, cfg, fuse_for=model_cfg)
        b, p = prompts.tokens_BP.shape
        static = cfg.static_kv_scales
        cache = init_cache(
            model_cfg, b, p, dtype=jnp.dtype(cfg.kv_cache_dtype),
            mode=cfg.kv_scale_mode if cfg.fp8_kv else "none",
            k_scale=kv_scales.k if static else None, v_scale=kv_scales.v if static else None,
        )  # fmt: skip
        seg = prompt_segment_ids(prompts)
        pos = jnp.maximum(jnp.cumsum(seg, 1) - 1, 0)
        out = forward(
            weights, prompts.tokens_BP, model_cfg, positions_BT=pos, segment_ids_BT=seg,
            cache=cache, return_qkv_amax=True, last_logits_only=True, kernels=cfg.kernels,
        )  # fmt: skip
        return out.logits_BTV, out.cache, out.qkv_amax

    return prefill


def _timed(compiled, args, reps: int, warmup: int):
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def bench_variant(name, params, prompts, model_cfg, new, kv_scales, args, fallbacks) -> dict:
    """One variant: the rollout and the prefill program, compiled, then timed."""
    cfg = rollout_config(name, new)
    b, p = prompts.tokens_BP.shape
    row = dict(
        variant=name, batch=b, prompt_len=p, new_tokens=new, quant=cfg.quant is not None,
        kv_cache=cfg.kv_cache_dtype, kv_scale_mode=cfg.kv_scale_mode if cfg.fp8_kv else None,
        matmul_impl=cfg.matmul_impl, decode_attention_impl=cfg.decode_attention_impl,
    )  # fmt: skip
    seen = len(fallbacks.lines)
    kv = kv_scales if cfg.static_kv_scales else None
    rng = jax.random.key(1)
    fn = lambda w, pr, r, s: rollout(w, pr, model_cfg, cfg, r, s)
    compiled, row["compile_s"] = bc.compile_fn(fn, params, prompts, rng, kv)
    row["e2e_s"], (ro, metrics) = _timed(
        compiled, (params, prompts, rng, kv), args.reps, args.warmup
    )
    del compiled
    lens = np.asarray(ro.response_lens_B)
    row["all_rows_full_budget"] = bool(np.all(lens == new))
    row["logp_finite"] = bool(np.all(np.isfinite(np.asarray(ro.logp_BT))))
    pre, row["prefill_compile_s"] = bc.compile_fn(prefill_fn(model_cfg, cfg), params, prompts, kv)
    row["prefill_s"], (_, _, amax) = _timed(pre, (params, prompts, kv), max(args.reps, 3), 1)
    decode_s = row["e2e_s"] - row["prefill_s"]
    row |= dict(
        decode_s=decode_s, e2e_tok_s=b * new / row["e2e_s"],
        decode_tok_s=b * (new - 1) / decode_s if new > 1 and decode_s > 0 else None,
        ms_per_step=1e3 * decode_s / (new - 1) if new > 1 else None,
        fallbacks=fallbacks.lines[seen:], quant_nonfinite=int(metrics["quant_nonfinite"]),
    )  # fmt: skip
    return row, amax


def kv_memory(cfg: ModelConfig, seq_len: int, budget_gib: float) -> list[dict]:
    """KV bytes per token (all layers, K and V, + dynamic scales) and the rows that fit."""
    rows = []
    for cache, item, scale_b in (("bf16", 2, 0), ("fp8 static", 1, 0), ("fp8 dynamic", 1, 4)):
        bpt = cfg.num_layers * 2 * cfg.num_kv_heads * (cfg.head_dim * item + scale_b)
        rows.append(dict(cache=cache, bytes_per_token=bpt, seq_len=seq_len, budget_gib=budget_gib,
                         max_batch=int(budget_gib * 2**30 // (bpt * seq_len))))  # fmt: skip
    return rows


HF_SCRIPT = r"""
import json, sys, time, torch, transformers
path, batch, plen, new, reps = sys.argv[1], *map(int, sys.argv[2:6])
torch.set_num_threads(int(sys.argv[6]))
m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
g = torch.Generator().manual_seed(0)
ids = torch.randint(1, m.config.vocab_size, (batch, plen), generator=g)
kw = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
          eos_token_id=None, attention_mask=torch.ones_like(ids))
times = []
with torch.no_grad():
    m.generate(ids, **kw)
    for _ in range(reps):
        t0 = time.perf_counter(); m.generate(ids, **kw); times.append(time.perf_counter() - t0)
times.sort()
print(json.dumps(dict(median_s=times[len(times) // 2], torch=torch.__version__,
                      transformers=transformers.__version__)))
"""


def _time_hf(path, batch, plen, new, reps, threads) -> dict:
    hfpy = bc.ROOT / ".hfvenv/bin/python"
    if not hfpy.exists():
        return dict(error=f"{hfpy} missing")
    argv = [str(hfpy), "-c", HF_SCRIPT, str(path), *map(str, (batch, plen, new, reps, threads))]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    if res.returncode:
        return dict(error=res.stderr[-2000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def hf_rows(plen: int, new: int, reps: int, threads: int) -> list[dict]:
    """Our greedy ``generate`` (f32) vs ``transformers`` generate on ``llama-small``, B = 1, 16."""
    cfg = MODELS["llama-small"]
    w32 = init_weights(cfg, jax.random.key(0), jnp.float32)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(tmp, cfg, w32)
        for batch in (1, 16):
            prompts = make_prompts(batch, plen, cfg.vocab_size)
            run = lambda prompts=prompts: generate(
                w32, prompts, cfg, SamplingConfig(temperature=0.0), jax.random.key(0),
                max_new_tokens=new, kv_cache_dtype="float32",
            ).tokens_BT  # fmt: skip
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            compile_s = time.perf_counter() - t0
            ours, _ = _timed(run, (), reps, 0)
            hf = _time_hf(tmp, batch, plen, new, reps, threads)
            row = dict(name=f"ours-f32 vs hf-f32 B={batch}", batch=batch, ours_s=ours,
                       compile_s=compile_s, ours_tok_s=batch * new / ours, hf=hf)  # fmt: skip
            if "median_s" in hf:
                row |= dict(hf_tok_s=batch * new / hf["median_s"], speedup=hf["median_s"] / ours)
            rows.append(row)
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    head = ["variant", "B", "P", "A", "e2e s", "prefill s", "decode tok/s", "e2e tok/s",
            "ms/step", "x bf16 decode", "x bf16 e2e", "compile s", "full budget",
            "fallbacks"]  # fmt: skip
    body = [
        [r["variant"], r["batch"], r["prompt_len"], r["new_tokens"], r.get("e2e_s"),
         r.get("prefill_s"), r.get("decode_tok_s"), r.get("e2e_tok_s"), r.get("ms_per_step"),
         r.get("speedup_decode_vs_bf16"), r.get("speedup_e2e_vs_bf16"),
         (r.get("compile_s") or 0) + (r.get("prefill_compile_s") or 0),
         r.get("all_rows_full_budget", r.get("error")), len(r.get("fallbacks", []))]
        for r in rows
    ]  # fmt: skip
    title = (
        f"## rollout, {meta['model']} with random weights ({meta['device_kind']}, "
        f"jax {meta['jax']})\n\n"
    )
    out = title + bc.md_table(head, body)
    if meta.get("kv_memory"):
        mem = [[m["cache"], m["bytes_per_token"], m["max_batch"]] for m in meta["kv_memory"]]
        out += f"\nKV cache, {meta['kv_memory'][0]['budget_gib']} GiB, "
        out += f"{meta['kv_memory'][0]['seq_len']}-token rows:\n\n"
        out += bc.md_table(["cache", "bytes/token", "rows that fit"], mem)
    for h in meta.get("hf", []):
        out += f"\n{h['name']}: ours {h['ours_tok_s']:.1f} tok/s, hf {h.get('hf_tok_s', '-')}\n"
    return out


def _speedups(rows: list[dict]) -> None:
    base = next((r for r in rows if r["variant"] == "bf16" and "e2e_tok_s" in r), None)
    for r in rows:
        for kind in ("e2e", "decode"):
            if base and r.get(f"{kind}_tok_s") and base.get(f"{kind}_tok_s"):
                r[f"speedup_{kind}_vs_bf16"] = r[f"{kind}_tok_s"] / base[f"{kind}_tok_s"]


def _fp8_attention_stages() -> int:
    """The K/V ring depth of the Hopper FP8-cache attention kernels' default (the performance
    model's validation predicts this run at it)."""
    from kernels_pallas.decode_attention import pallas_mosaic_gpu as mgpu

    return mgpu.default_stages(jnp.float8_e4m3fn)


def _decode_tiles() -> dict:
    """How the Hopper fp8_matmul's decode tiles run by default: several 128-K slices per
    pipeline step, launched dependent (the performance model's validation predicts this run
    with the tiles it ran)."""
    from kernels_pallas.fp8_matmul import mgpu_config

    cfg = mgpu_config.default_config(32, 4096, 4096)
    return dict(decode_k_slices=cfg.k_slices > 1, decode_pdl=cfg.pdl)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model (CPU, seconds)")
    ap.add_argument("--model", choices=list(MODELS), default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new", type=int, default=None, help="response tokens per row")
    ap.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    ap.add_argument("--reps", type=int, default=None, help="timed rollouts (GPU 1, CPU 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rollouts (GPU 0, CPU 1)")
    ap.add_argument("--budget-gib", type=float, default=40.0, help="KV memory table budget")
    ap.add_argument("--hf", action="store_true", help="add ours vs transformers (CPU)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for --hf")
    ap.add_argument("--out", default=None, help="JSON path (default results/bench_rollout_<dev>)")
    args = ap.parse_args(argv)
    on_gpu = jax.devices()[0].platform == "gpu"
    model = args.model or ("tiny" if args.quick else "qwen3-1.7b" if on_gpu else "llama-small")
    b, p, a = SHAPES[model]
    b, p, a = args.batch or b, args.prompt_len or p, args.new or a
    args.reps = args.reps or (1 if on_gpu else 3)
    args.warmup = (0 if on_gpu else 1) if args.warmup is None else args.warmup
    cfg = MODELS[model]
    meta = bc.env_meta() | dict(
        bench="rollout", model=model, model_config=str(cfg), quick=args.quick, reps=args.reps,
        warmup=args.warmup, data="random weights (init_weights, BF16), random prompt ids, "
        "temperature 1, no stop tokens", kv_memory=kv_memory(cfg, p + a, args.budget_gib),
        fp8_attention_stages=_fp8_attention_stages(), **_decode_tiles(),
    )  # fmt: skip
    out = args.out or bc.default_out("bench_rollout")
    fallbacks = _Fallbacks()
    logging.getLogger("kernels_pallas.backend").addHandler(fallbacks)
    params = init_weights(cfg, jax.random.key(0), jnp.bfloat16)
    prompts = make_prompts(b, p, cfg.vocab_size)
    print(f"device={meta['device_kind']} jax={meta['jax']} model={model} B={b} P={p} A={a}")
    rows, kv_scales = [], None
    for name in args.variants:
        if rollout_config(name, a).static_kv_scales and kv_scales is None:  # no bf16 row ran
            kv_scales = calibrate_program(cfg, rollout_config(name, a))(params, prompts)
        try:
            row, amax = bench_variant(name, params, prompts, cfg, a, kv_scales, args, fallbacks)
            if name == "bf16":  # the step-0 calibration pass: a BF16 prefill over the prompts
                kv_scales = calibrate_kv_scales(amax, 99.9, 1.05)
        except Exception as e:  # noqa: BLE001 - one failed variant must not end the run
            row = dict(variant=name, batch=b, prompt_len=p, new_tokens=a,
                       error=f"{type(e).__name__}: {str(e)[:500]}")  # fmt: skip
        rows.append(row)
        _speedups(rows)
        print({k: v for k, v in row.items() if k != "fallbacks"})
        bc.write_results(out, meta, rows, markdown(meta, rows))
    if args.hf:
        meta["hf"] = hf_rows(32, 64, args.reps, args.threads)
        bc.write_results(out, meta, rows, markdown(meta, rows))
    print(markdown(meta, rows))
    print(f"wrote {out}")
    return dict(meta=meta, rows=rows)


if __name__ == "__main__":
    main()
