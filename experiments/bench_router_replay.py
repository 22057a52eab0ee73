"""Mismatch between rollout and BF16 scoring on a tiny MoE: BF16 / FP8 / FP8 + routing replay.

Three arms run the same short RL run (same initial weights, prompts, seeds, reward):
  * ``bf16``: BF16 rollout (``quant=None``), BF16 scoring;
  * ``fp8``: FP8 W8A8 rollout (experts through ``grouped_fp8_matmul``), BF16 scoring;
  * ``fp8_replay``: the same with ``rl.router_replay="replay"``: the scoring pass and the loss
    forward route every token with the experts the FP8 rollout chose (R3, arXiv 2510.11370).
Per step it records the rollout-correction metrics of the batch (``rl.correction``): ``k3_kl``
= mean over response tokens of ``ρ − 1 − log ρ`` (``ρ = π_bf16 / π_rollout``, a non-negative KL
estimate), ``kl`` (k1: mean ``log π_rollout − log π_bf16``) and ``token_mult_prob_error``; for
the replay arm also the fraction of recorded (token, MoE layer) pairs whose BF16 top-k differs
from the rollout's (what replay overrides). Prints the table of means over the run and writes
JSON.

Model: Qwen3-MoE-style, D=64, 2 MoE layers, E=8, top-2, expert F=64, vocab 64, random weights;
8 prompts x G=4 responses of up to 16 tokens, temperature 1; reward: the fraction of even
response tokens (a toy task the policy can learn); Adam lr 3e-3.

  PYTHONPATH=$PWD .venv/bin/python experiments/bench_router_replay.py --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from fp8rl_jax.generation import RolloutConfig, SamplingConfig, make_prompts  # noqa: E402
from fp8rl_jax.models import forward, init_weights  # noqa: E402
from fp8rl_jax.rl import RLConfig, init_train_state, jit_steps  # noqa: E402
from fp8rl_jax.train.experiment import ModelSpec  # noqa: E402

VOCAB, G, PROMPTS = 64, 4, 8
MODEL = ModelSpec(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
    architecture="Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=64,
).tiny_config(VOCAB)  # fmt: skip
METRICS = ("k3_kl", "kl", "token_mult_prob_error")


def arms(max_new: int) -> dict[str, tuple[RolloutConfig, RLConfig]]:
    base = RolloutConfig(max_new_tokens=max_new, sampling=SamplingConfig(temperature=1.0))
    bf16 = RolloutConfig(
        max_new_tokens=max_new, sampling=SamplingConfig(temperature=1.0), quant=None
    )
    rl = RLConfig(group_size=G)
    return {
        "bf16": (bf16, rl),
        "fp8": (base, rl),
        "fp8_replay": (base, RLConfig(group_size=G, router_replay="replay")),
    }


def prompts(step: int):
    rng = np.random.default_rng(step)
    rows = [rng.integers(3, VOCAB, size=int(rng.integers(4, 12))).tolist() for _ in range(PROMPTS)]
    return make_prompts([r for r in rows for _ in range(G)])


def even_reward(batch) -> jax.Array:
    tok, mask = np.asarray(batch.tokens_BT), np.asarray(batch.response_mask_BT)
    hits = ((tok % 2 == 0) * mask).sum(1) / np.maximum(mask.sum(1), 1)
    return jnp.asarray(hits, jnp.float32)


def routing_disagreement(params, batch) -> float:
    """Fraction of recorded (token, layer) whose BF16 top-k set differs from the rollout's."""
    ids = np.asarray(batch.expert_ids_BTLK)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    own = forward(
        bf16, batch.tokens_BT, MODEL, positions_BT=batch.positions_BT,
        segment_ids_BT=batch.segment_ids_BT, return_expert_ids=True,
    ).expert_ids_BTLK  # fmt: skip
    recorded = ids[..., 0] >= 0
    same = np.sort(np.asarray(own), -1) == np.sort(ids, -1)
    return float(np.mean(~np.all(same, -1)[recorded]))


def run_arm(params, rollout_cfg, rl_cfg, steps: int) -> list[dict]:
    optimizer = optax.adam(3e-3)
    prog = jit_steps(MODEL, rollout_cfg, rl_cfg, optimizer)
    state = init_train_state(params, optimizer, jax.random.key(1))
    rows = []
    for t in range(steps):
        generating = jax.tree.map(jnp.copy, state.params)  # the state is donated below
        batch = prog.rollout(state, prompts(t))
        rewards = even_reward(batch)
        state, m = prog.train(state, batch, rewards)
        row = {k: float(batch.metrics[k]) for k in METRICS}
        row["reward"] = float(jnp.mean(rewards))
        if batch.expert_ids_BTLK is not None:
            row["routing_disagreement"] = routing_disagreement(generating, batch)
        rows.append(row)
        print(f"  step {t}: " + " ".join(f"{k}={v:.3g}" for k, v in row.items()), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument(
        "--out", default=os.path.join(REPO, "experiments/results/router_replay.json")
    )
    args = parser.parse_args()
    params = init_weights(MODEL, jax.random.key(0), jnp.float32)
    params["embed"] = params["embed"] / MODEL.hidden_size**0.5  # O(1) logits
    results = {}
    for name, (ro_cfg, rl_cfg) in arms(args.max_new_tokens).items():
        print(name, flush=True)
        results[name] = run_arm(params, ro_cfg, rl_cfg, args.steps)
    keys = (*METRICS, "routing_disagreement")
    print(f"\nmeans over {args.steps} steps ({PROMPTS}x{G} rows, <= {args.max_new_tokens} tokens)")
    print(f"{'arm':<12}" + "".join(f"{k:>24}" for k in keys))
    summary = {}
    for name, rows in results.items():
        summary[name] = {k: float(np.mean([r[k] for r in rows])) for k in keys if k in rows[0]}
        cells = "".join(f"{summary[name].get(k, float('nan')):>24.4g}" for k in keys)
        print(f"{name:<12}" + cells)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": str(MODEL), "summary": summary, "steps": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
