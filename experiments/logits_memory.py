"""Compiled temp memory of the scoring pass and the train program, full vs chunked logits.

Compiles (never runs) for the local backend, from shapes only: the rollout program's scoring
(``rl.scoring.sequence_logprobs`` with Q/K/V amax, as ``rl.rollout_step``) and the whole train
program (``rl.train_step``: loss, backward, optax update), each with today's one-shot logits
(``logprob_chunk=0``, no micro-batches, no remat) and with the memory knobs. Prints XLA's
``memory_analysis()`` temp bytes and the size of one [B, T, V] f32 logits buffer.

  python experiments/logits_memory.py --rows=8 --tokens=1024 --vocab=151936
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import optax

from fp8rl_jax.generation import RolloutConfig
from fp8rl_jax.models import QKVAmax, init_weights
from fp8rl_jax.rl import RLConfig, RolloutBatch, StepConfig, init_train_state, train_step
from fp8rl_jax.rl.scoring import sequence_logprobs
from fp8rl_jax.train.experiment import ModelSpec

GiB = 2**30


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8)  # B
    p.add_argument("--tokens", type=int, default=1024)  # T = P + A
    p.add_argument("--vocab", type=int, default=151936)  # V (Qwen3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)  # D
    p.add_argument("--chunk", type=int, default=512)  # rl.logprob_chunk
    p.add_argument("--micro-batch", type=int, default=2)  # rl.score_micro_batch
    p.add_argument("--remat", default="block")  # rl.remat
    return p.parse_args()


def _batch(B, T, L_amax, K) -> RolloutBatch:
    f32, i32 = jnp.float32, jnp.int32
    s = jax.ShapeDtypeStruct
    amax = QKVAmax(*(s((L_amax, K), f32) for _ in range(3)))
    return RolloutBatch(
        *(s((B, T), i32) for _ in range(3)), *(s((B, T), f32) for _ in range(5)),
        qkv_amax=amax, metrics={},
    )  # fmt: skip


def _temp_gib(fn, *args) -> float:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / GiB


def main():
    a = _args()
    spec = ModelSpec(
        hidden_size=a.hidden, num_layers=a.layers, num_heads=a.hidden // 128, num_kv_heads=1,
        head_dim=128, intermediate_size=3 * a.hidden,
    )  # fmt: skip
    model = spec.tiny_config(a.vocab)
    rollout = RolloutConfig(max_new_tokens=a.tokens // 2, compute_dtype="bfloat16")
    params = jax.eval_shape(lambda: init_weights(model, jax.random.key(0), jnp.float32))
    B, T = a.rows, a.tokens
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
    opt = optax.adamw(1e-6)
    state = jax.eval_shape(lambda p: init_train_state(p, opt, jax.random.key(0)), params)
    batch = _batch(B, T, a.layers, 1)
    rewards = jax.ShapeDtypeStruct((B,), jnp.float32)
    print(f"[B, T, V] f32 logits: {B * T * a.vocab * 4 / GiB:.3f} GiB  (B={B} T={T} V={a.vocab})")
    base = RLConfig(group_size=B)
    knobs = dataclasses.replace(
        base, logprob_chunk=a.chunk, score_micro_batch=a.micro_batch, remat=a.remat
    )
    for name, rl in (("one-shot", base), ("knobs", knobs)):

        def score(p, t, rl=rl):
            out = sequence_logprobs(
                p, t, t, jnp.ones_like(t), model, rollout.sampling, with_amax=True,
                logprob_chunk=rl.logprob_chunk, micro_batch=rl.score_micro_batch,
            )  # fmt: skip
            return out.logp_BT, out.qkv_amax

        cfg = StepConfig(model, rollout, rl)
        train = jax.jit(lambda s, b, r, cfg=cfg: train_step(s, b, r, cfg, opt))
        score_gib = _temp_gib(jax.jit(score), params, tokens)
        train_gib = _temp_gib(train, state, batch, rewards)
        print(
            f"{name:9s} (chunk={rl.logprob_chunk}, micro_batch={rl.score_micro_batch}, "
            f"remat={rl.remat}): scoring temp {score_gib:.3f} GiB, train temp {train_gib:.3f} GiB"
        )


if __name__ == "__main__":
    main()
