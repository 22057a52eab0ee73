"""Rollout/trainer mismatch, BF16 scoring vs ``rl.train_precision="fp8_rollout"`` scoring.

For each tiny model (dense; MoE; MoE with routing replay), rollout engine (static, paged) and KV
cache (BF16; FP8 E4M3 with static scales), one FP8 W8A8 rollout is sampled and scored twice:
by the BF16 policy (the default scoring pass) and by the rollout's own FP8 numerics
(``fp8_rollout``). Per scoring: k3-KL ``mean(ρ − 1 − log ρ)`` and ``max |log ρ|`` over the
response tokens, ``log ρ = log π_score − log π_rollout``. A last row per model reruns the
static engine with the jnp decode attention (``rollout.decode_attention_impl=None``) to isolate
the decode-attention kernel's reduction order.

Random-init weights (logits O(1)), 16 prompts x 32 new tokens, temperature 1, 2 CPU cores:

  PYTHONPATH=$PWD .venv/bin/python experiments/mismatch_table.py   # ~5 min
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fp8rl_jax.generation import (  # noqa: E402
    PagedConfig,
    RolloutConfig,
    SamplingConfig,
    make_prompts,
    rollout,
)
from fp8rl_jax.models import init_weights  # noqa: E402
from fp8rl_jax.rl import RLConfig, calibrate_program  # noqa: E402
from fp8rl_jax.rl.precision import policy_weights  # noqa: E402
from fp8rl_jax.rl.scoring import rollout_segment_ids, sequence_logprobs  # noqa: E402
from fp8rl_jax.rl.state import StepConfig  # noqa: E402
from fp8rl_jax.train.experiment import ModelSpec  # noqa: E402

OUT = os.path.join(REPO, "experiments", "results", "mismatch_table.json")
VOCAB = 64
_ARCH = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
MODELS = {
    "dense": ModelSpec(**_ARCH, intermediate_size=128).tiny_config(VOCAB),
    "moe": ModelSpec(
        **_ARCH,
        intermediate_size=128,
        architecture="Qwen3MoeForCausalLM",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    ).tiny_config(VOCAB),  # fmt: skip
}
PRECISIONS = ("bf16", "fp8_rollout")


def _params(model_cfg):
    params = init_weights(model_cfg, jax.random.key(0), jnp.float32)
    params["embed"] = params["embed"] / model_cfg.hidden_size**0.5
    return params


def _prompts(n: int):
    rng = np.random.default_rng(0)
    return make_prompts([rng.integers(3, VOCAB, size=int(rng.integers(4, 16))).tolist()
                         for _ in range(n)])  # fmt: skip


def _stats(logp_score, logp_roll, mask):
    log_rho = np.where(mask, np.asarray(logp_score) - np.asarray(logp_roll), 0.0)
    rho = np.exp(log_rho)
    k3 = float(np.sum(np.where(mask, rho - 1.0 - log_rho, 0.0)) / max(mask.sum(), 1))
    return {"k3_kl": k3, "max_abs_log_ratio": float(np.max(np.abs(log_rho)))}


def measure(model_name, replay, ro_cfg, prompts):
    """One rollout, scored in both precisions: {precision: stats}."""
    model_cfg = MODELS[model_name]
    params = _params(model_cfg)
    kv = calibrate_program(model_cfg, ro_cfg)(params, prompts)
    step_cfgs = {
        p: StepConfig(model_cfg, ro_cfg, RLConfig(train_precision=p, router_replay=replay))
        for p in PRECISIONS
    }
    record = replay == "replay"

    @jax.jit
    def run(params, prompts, kv):
        ro, _ = rollout(params, prompts, model_cfg, ro_cfg, jax.random.key(1), kv,
                        record_expert_ids=record)  # fmt: skip
        seg = rollout_segment_ids(ro)
        pos = jnp.maximum(jnp.cumsum(seg, axis=1) - 1, 0)
        scores = {}
        for p, cfg in step_cfgs.items():
            weights, kv_quant = policy_weights(params, cfg, kv)
            scores[p] = sequence_logprobs(
                weights, ro.tokens_BT, pos, seg, model_cfg, ro_cfg.sampling,
                expert_ids_BTLK=ro.expert_ids_BTLK, kv_quant=kv_quant,
            ).logp_BT  # fmt: skip
        return ro.logp_BT, ro.response_mask_BT, scores

    logp_roll, mask, scores = run(params, prompts, kv)
    mask = np.asarray(mask)
    out = {p: _stats(scores[p], logp_roll, mask) for p in PRECISIONS}
    out["response_tokens"] = int(mask.sum())
    return out


def rows(args):
    """(model, replay, engine, kv, decode attention) of every row of the table."""
    out = []
    arms = (("dense", "none"), ("moe", "none"), ("moe", "replay"))
    for model, replay in [a for a in arms if not args.arm or "-".join(a) in args.arm]:
        for engine in ("static", "paged"):
            for kv in ("bfloat16", "float8_e4m3fn"):
                out.append((model, replay, engine, kv, "auto"))
        if not args.no_jnp_row:
            out.append((model, replay, "static", "float8_e4m3fn", None))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--markdown", action="store_true", help="print --out's table as markdown")
    ap.add_argument(
        "--arm", action="append", default=[], help="only dense-none|moe-none|moe-replay"
    )
    ap.add_argument("--no-jnp-row", action="store_true", help="skip the jnp decode-attention row")
    args = ap.parse_args(argv)
    if args.markdown:
        with open(args.out) as f:
            print(markdown(json.load(f)["rows"]))
        return
    prompts = _prompts(args.prompts)
    table = []
    for model, replay, engine, kv, dec in rows(args):
        ro_cfg = RolloutConfig(
            sampling=SamplingConfig(temperature=1.0), max_new_tokens=args.new_tokens,
            kv_cache_dtype=kv, engine=engine, decode_attention_impl=dec,
            paged=PagedConfig(page_size=16),
        )  # fmt: skip
        row = dict(model=model, replay=replay, engine=engine, kv_cache=kv,
                   decode_attention="kernel op (xla)" if dec else "jnp attention")  # fmt: skip
        t0 = time.time()
        try:
            row.update(measure(model, replay, ro_cfg, prompts))
        except TypeError as e:  # an engine without routing-replay recording
            row["unsupported"] = str(e).splitlines()[0]
        row["seconds"] = round(time.time() - t0, 1)
        table.append(row)
        print(_fmt(row), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(prompts=args.prompts, new_tokens=args.new_tokens, rows=table), f, indent=1)
    print(f"wrote {args.out}")


def markdown(table) -> str:
    """The README table: one row per (model, replay, engine, KV cache, decode attention)."""
    out = [
        "| model | replay | engine | KV cache | decode attn | k3 BF16 | k3 fp8_rollout "
        "| max BF16 | max fp8_rollout |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        head = (f"| {r['model']} | {r['replay']} | {r['engine']} | {r['kv_cache']} "
                f"| {r['decode_attention']} ")  # fmt: skip
        if "unsupported" in r:
            out.append(head + "| not supported | | | |")
            continue
        b, f = r["bf16"], r["fp8_rollout"]
        out.append(head + f"| {b['k3_kl']:.1e} | {f['k3_kl']:.1e} | {b['max_abs_log_ratio']:.2f} "
                   f"| {f['max_abs_log_ratio']:.1e} |")  # fmt: skip
    return "\n".join(out)


def _fmt(row) -> str:
    head = f"{row['model']:5} {row['replay']:6} {row['engine']:6} {row['kv_cache']:13} " + (
        f"{row['decode_attention']:16}"
    )
    if "unsupported" in row:
        return f"{head} unsupported: {row['unsupported']}"
    b, f = row["bf16"], row["fp8_rollout"]
    return (f"{head} bf16: k3 {b['k3_kl']:.2e} max|lr| {b['max_abs_log_ratio']:.2e} | "
            f"fp8_rollout: k3 {f['k3_kl']:.2e} max|lr| {f['max_abs_log_ratio']:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
