"""Benchmark the rollout engine against ``transformers`` generate, and BF16 vs FP8 variants.

Same run, same random weights (Llama architecture, saved with ``save_hf_checkpoint``):
  * ours (``fp8rl_jax.generation.generate``, f32) vs ``transformers`` greedy ``generate`` (torch
    CPU, f32, run by ``.hfvenv/bin/python`` in a subprocess) at batch 1 and 16; goals >= 3x and
    >= 1.5x tokens/s;
  * BF16 vs FP8 W8A8 vs FP8 W8A8 + FP8 KV (dynamic and static scales). On CPU FP8 is emulated
    (dequantize then matmul): report only, not an FP8 result;
  * KV-cache bytes per token and the largest batch that fits a memory budget, per cache dtype.
Timing: one warm-up call (compiles), then the median of ``--reps`` calls (wall clock,
``block_until_ready``); every row generates exactly ``--new`` tokens (no stop tokens).
Usage: ``python experiments/bench_rollout.py`` (CPU, ~3 min). Writes experiments/results/.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.generation import SamplingConfig, calibrate_kv_scales, generate, make_prompts
from fp8rl_jax.models import ModelConfig, forward, init_weights, save_hf_checkpoint
from fp8rl_jax.quant import QuantRecipe, quantize_params

ROOT = pathlib.Path(__file__).resolve().parents[1]
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


def model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=64, intermediate_size=512, max_position_embeddings=1024,
    )  # fmt: skip


def time_ours(weights, cfg, batch, plen, new, reps, **kv) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    prompts = make_prompts(rng.integers(1, cfg.vocab_size, (batch, plen)).tolist(), buckets=(plen,))
    run = lambda: generate(
        weights, prompts, cfg, SamplingConfig(temperature=0.0), jax.random.key(0),
        max_new_tokens=new, **kv,
    ).tokens_BT.block_until_ready()  # fmt: skip
    t0 = time.perf_counter()
    run()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), compile_s


def time_hf(path, batch, plen, new, reps, threads) -> dict:
    hfpy = ROOT / ".hfvenv/bin/python"
    if not hfpy.exists():
        return dict(error=f"{hfpy} missing")
    args = [str(hfpy), "-c", HF_SCRIPT, str(path), *map(str, (batch, plen, new, reps, threads))]
    res = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    if res.returncode:
        return dict(error=res.stderr[-2000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def kv_bytes_per_token(cfg: ModelConfig, dtype: str, mode: str) -> int:
    """Bytes one token adds to the cache over all layers (K and V, plus dynamic scales)."""
    item = jnp.dtype(dtype).itemsize
    per_layer = 2 * cfg.num_kv_heads * cfg.head_dim * item
    if mode == "dynamic":
        per_layer += 2 * cfg.num_kv_heads * 4
    return cfg.num_layers * per_layer


def memory_table(budget_gib: float, seq_len: int) -> list[dict]:
    qwen3_8b = ModelConfig(
        vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
        head_dim=128, intermediate_size=12288,
    )  # fmt: skip
    rows = []
    for dtype, mode in (
        ("bfloat16", "none"),
        ("float8_e4m3fn", "static"),
        ("float8_e4m3fn", "dynamic"),
    ):
        bpt = kv_bytes_per_token(qwen3_8b, dtype, mode)
        rows.append(dict(model="Qwen3-8B shape", cache=f"{dtype}/{mode}", bytes_per_token=bpt,
                         seq_len=seq_len, budget_gib=budget_gib,
                         max_batch=int(budget_gib * 2**30 // (bpt * seq_len))))  # fmt: skip
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-gib", type=float, default=40.0)
    args = ap.parse_args()
    cfg = model_config()
    w32 = init_weights(cfg, jax.random.key(0), jnp.float32)
    out = dict(
        device=str(jax.devices()[0]),
        jax=jax.__version__,
        python=platform.python_version(),
        model=str(cfg),
        prompt_len=args.prompt_len,
        new_tokens=args.new,
        data="random weights (init_weights), random prompt ids, greedy",
        rows=[],
    )
    try:
        out["git_sha"] = subprocess.check_output(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, text=True
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        out["git_sha"] = None
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(tmp, cfg, w32)
        for batch in (1, 16):
            hf = time_hf(tmp, batch, args.prompt_len, args.new, args.reps, args.threads)
            t, c = time_ours(w32, cfg, batch, args.prompt_len, args.new, args.reps,
                             kv_cache_dtype="float32")  # fmt: skip
            toks = batch * args.new
            row = dict(name=f"ours-f32 vs hf-f32 B={batch}", batch=batch, ours_s=t, compile_s=c,
                       ours_tok_s=toks / t, hf=hf)  # fmt: skip
            if "median_s" in hf:
                row["hf_tok_s"] = toks / hf["median_s"]
                row["speedup"] = hf["median_s"] / t
            out["rows"].append(row)
    wbf = jax.tree.map(lambda x: x.astype(jnp.bfloat16), w32)
    wq = quantize_params(wbf, QuantRecipe())
    calib = forward(wbf, jnp.ones((4, args.prompt_len), jnp.int32) * 7, cfg, return_qkv_amax=True)
    scales = calibrate_kv_scales(calib.qkv_amax)
    variants = {
        "bf16 W, bf16 KV": (wbf, dict(kv_cache_dtype="bfloat16")),
        "fp8 W8A8, bf16 KV": (wq, dict(kv_cache_dtype="bfloat16")),
        "fp8 W8A8, fp8 KV static": (wq, dict(kv_cache_dtype="float8_e4m3fn", kv_scales=scales)),
        "fp8 W8A8, fp8 KV dynamic": (
            wq,
            dict(kv_cache_dtype="float8_e4m3fn", kv_scale_mode="dynamic"),
        ),
    }
    for name, (w, kv) in variants.items():
        t, c = time_ours(w, cfg, 16, args.prompt_len, args.new, args.reps, **kv)
        out["rows"].append(
            dict(
                name=f"{name} B=16",
                batch=16,
                ours_s=t,
                compile_s=c,
                ours_tok_s=16 * args.new / t,
                emulated_fp8_on_cpu=True,
            )
        )
    out["kv_memory"] = memory_table(args.budget_gib, 4096)
    print(f"{'row':42s} {'ours tok/s':>11s} {'hf tok/s':>9s} {'speedup':>8s} {'compile s':>9s}")
    for r in out["rows"]:
        hf = f"{r['hf_tok_s']:9.1f}" if "hf_tok_s" in r else f"{'-':>9s}"
        sp = f"{r['speedup']:8.2f}" if "speedup" in r else f"{'-':>8s}"
        print(f"{r['name']:42s} {r['ours_tok_s']:11.1f} {hf} {sp} {r['compile_s']:9.1f}")
    print(f"\nKV cache, {args.budget_gib} GiB budget, 4096-token sequences:")
    for r in out["kv_memory"]:
        bpt, mb = r["bytes_per_token"], r["max_batch"]
        print(f"  {r['model']} {r['cache']:24s} {bpt:8d} B/token  max batch {mb}")
    dst = ROOT / "experiments/results" / f"bench_rollout_{jax.devices()[0].platform}.json"
    dst.write_text(json.dumps(out, indent=1))
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
