"""Benchmark our jitted ``forward`` against ``transformers`` on CPU, same weights, same run.

Method: a random model is built in our format, saved with ``save_hf_checkpoint`` and loaded by
``AutoModelForCausalLM.from_pretrained`` in the torch side venv (``.hfvenv``, Python 3.11: torch
is not installable in the project venv), run as a subprocess on the same token batch. Each row
warms up twice, then times ``--runs`` full forwards (wall clock, ``block_until_ready`` /
``torch.inference_mode``) and reports the median and p20/p80 and tokens/s = B*T / median. The
float32 logits of both sides are compared (max abs diff) to show they compute the same function.

Rows: ``ours_f32``, ``ours_bf16``, ``ours_fp8`` (``quantize_params``: W8A8 blockwise; on CPU the
jnp reference dequantizes, so it measures the emulation, not FP8 speed), ``hf_f32``,
``hf_bf16`` (eager attention, ``torch.inference_mode``).

Usage: ``.venv/bin/python experiments/bench_forward.py [--arch llama|qwen3_moe] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.models import ModelConfig, forward, init_weights, save_hf_checkpoint
from fp8rl_jax.quant import QuantRecipe, quantize_params

ROOT = pathlib.Path(__file__).resolve().parents[1]
HF_PYTHON = ROOT / ".hfvenv" / "bin" / "python"

# The torch side: argv = checkpoint dir, tokens .npy, runs, output json, logits .npy.
HF_HELPER = r"""
import json, sys, time
import numpy as np, torch, transformers
ckpt, tokens_file, runs, out_file, logits_file = sys.argv[1:6]
tokens = torch.from_numpy(np.load(tokens_file)).long()
rows = {}
for name, dtype in (("hf_f32", torch.float32), ("hf_bf16", torch.bfloat16)):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=dtype, attn_implementation="eager").eval()
    times = []
    with torch.inference_mode():
        for i in range(int(runs) + 2):
            t0 = time.perf_counter()
            logits = model(input_ids=tokens).logits
            if i >= 2:
                times.append(time.perf_counter() - t0)
    if dtype == torch.float32:
        np.save(logits_file, logits.float().numpy())
    rows[name] = times
meta = dict(torch=torch.__version__, transformers=transformers.__version__,
            threads=torch.get_num_threads())
json.dump(dict(rows=rows, meta=meta), open(out_file, "w"))
"""


def _config(arch: str) -> ModelConfig:
    common = dict(vocab_size=4096, hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32)
    if arch == "llama":
        return ModelConfig(
            **common, num_layers=4, intermediate_size=768, architecture="LlamaForCausalLM"
        )
    if arch == "qwen3_moe":
        return ModelConfig(
            **common,
            num_layers=4,
            intermediate_size=768,
            qk_norm=True,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
            architecture="Qwen3MoeForCausalLM",
        )
    raise ValueError(f"--arch {arch!r}: use llama or qwen3_moe")


def _time_ours(weights, tokens, cfg, runs: int):
    f = jax.jit(lambda w, t: forward(w, t, cfg).logits_BTV)
    for _ in range(2):
        out = jax.block_until_ready(f(weights, tokens))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(f(weights, tokens))
        times.append(time.perf_counter() - t0)
    return times, np.asarray(out)


def _run_hf(ckpt: pathlib.Path, tokens: np.ndarray, runs: int, tmp: pathlib.Path):
    np.save(tmp / "tokens.npy", tokens)
    cmd = [str(HF_PYTHON), "-c", HF_HELPER, str(ckpt), str(tmp / "tokens.npy"), str(runs)]
    cmd += [str(tmp / "hf.json"), str(tmp / "hf_logits.npy")]
    subprocess.run(cmd, check=True)
    res = json.loads((tmp / "hf.json").read_text())
    return res["rows"], res["meta"], np.load(tmp / "hf_logits.npy")


def _git_sha() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama", help="llama | qwen3_moe")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="batch 2, seq 64, 5 runs")
    ap.add_argument("--out", default=None, help="JSON path (default results/bench_forward_...)")
    args = ap.parse_args()
    B, T, runs = (2, 64, 5) if args.quick else (args.batch, args.seq, args.runs)
    cfg = _config(args.arch)
    w32 = init_weights(cfg, jax.random.key(0), jnp.float32)
    tokens = np.random.default_rng(0).integers(1, cfg.vocab_size, (B, T)).astype(np.int32)
    rows, logits = {}, {}
    rows["ours_f32"], logits["ours"] = _time_ours(w32, jnp.asarray(tokens), cfg, runs)
    w16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), w32)
    rows["ours_bf16"], _ = _time_ours(w16, jnp.asarray(tokens), cfg, runs)
    rows["ours_fp8"], _ = _time_ours(quantize_params(w16, QuantRecipe()), tokens, cfg, runs)
    hf_meta, diff = {"skipped": f"{HF_PYTHON} not found"}, None
    if HF_PYTHON.exists():
        with tempfile.TemporaryDirectory() as tmp:
            tmp = pathlib.Path(tmp)
            save_hf_checkpoint(tmp / "ckpt", cfg, w32)
            hf_rows, hf_meta, hf_logits = _run_hf(tmp / "ckpt", tokens, runs, tmp)
        rows.update(hf_rows)
        diff = float(np.abs(hf_logits - logits["ours"]).max())
    results = []
    print(f"{args.arch} B={B} T={T} device={jax.devices()[0].device_kind} jax={jax.__version__}")
    print(f"{'impl':<10} {'median ms':>10} {'p20':>8} {'p80':>8} {'tokens/s':>10} {'x hf_f32':>9}")
    base = np.median(rows["hf_f32"]) if "hf_f32" in rows else None
    for name, t in rows.items():
        med = float(np.median(t))
        r = dict(impl=name, median_ms=med * 1e3, p20_ms=float(np.percentile(t, 20)) * 1e3,
                 p80_ms=float(np.percentile(t, 80)) * 1e3, tokens_per_s=B * T / med,
                 speedup_vs_hf_f32=float(base / med) if base else None)  # fmt: skip
        results.append(r)
        sp = f"{r['speedup_vs_hf_f32']:>9.2f}" if base else f"{'-':>9}"
        print(f"{name:<10} {r['median_ms']:>10.2f} {r['p20_ms']:>8.2f} {r['p80_ms']:>8.2f} "
              f"{r['tokens_per_s']:>10.0f} {sp}")  # fmt: skip
    print(f"max |logits_ours_f32 - logits_hf_f32| = {diff}")
    path = pathlib.Path(
        args.out or ROOT / f"experiments/results/bench_forward_{args.arch}_cpu.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        git_sha=_git_sha(), jax_version=jax.__version__, device=jax.devices()[0].device_kind,
        arch=args.arch, config=cfg.to_hf_config("float32"), batch=B, seq=T, runs=runs,
        data="tokens ~ U[1, V); weights init_weights N(0, 1/fan_in), norms 1",
        timing="wall clock per full forward after 2 warm-up calls; median, p20, p80",
        hf=hf_meta, max_abs_logit_diff_f32=diff, python=sys.version.split()[0],
    )  # fmt: skip
    path.write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
