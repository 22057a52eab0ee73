"""Shared test helpers (as gemma's ``gm/testing``): the tiny policy, its weights and prompts.

One tiny Qwen3-style model (D=32, 2 layers, 2 query heads over 1 KV head, vocab 64) serves the
RL-step and rollout tests, so its programs look alike across files and stay cheap on 2 cores.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.generation import Prompts, make_prompts
from fp8rl_jax.models import ModelConfig, init_weights
from fp8rl_jax.train.experiment import ModelSpec

VOCAB = 64
TINY_MODEL: ModelConfig = ModelSpec(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
).tiny_config(VOCAB)


def tiny_params(cfg: ModelConfig = TINY_MODEL, seed: int = 0) -> dict:
    """FP32 weights with O(1) logits (embedding std 1/sqrt(D), as ``train.setup.build_model``)."""
    params = init_weights(cfg, jax.random.key(seed), jnp.float32)
    params["embed"] = params["embed"] / cfg.hidden_size**0.5
    return params


def tiny_prompts(lens: Sequence[int], group: int = 1, seed: int = 0) -> Prompts:
    """``group`` rows per entry of ``lens``, each of that many random ids in [3, VOCAB)."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(3, VOCAB, size=n).tolist() for n in lens for _ in range(group)]
    return make_prompts(rows)


def copy_tree(tree):
    """A copy that outlives donation (the train step donates its input state)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def assert_finite(metrics: dict) -> None:
    bad = {k: float(v) for k, v in metrics.items() if not np.isfinite(np.asarray(v)).all()}
    assert not bad, f"non-finite metrics: {bad}"


# The trainer-run tests (test_trainer, test_reliability) run experiments/train.py on this arm and
# these overrides, so one pytest session compiles their programs once (the compile cache).
TRAINER_ARM = "fp8kv_tis"  # FP8 W8A8 + FP8 KV cache with static scales: the most state to resume
TRAINER_STEPS = 6
TRAINER_FLAGS = {
    "model.hidden_size": 32,
    "model.num_heads": 2,
    "model.num_kv_heads": 1,
    "model.intermediate_size": 64,
    "sft.steps": 5,
    "sft.batch_size": 16,
    "rl.group_size": 4,
    "rl.num_minibatches": 2,
    "trainer.prompts_per_step": 4,
    "trainer.steps": TRAINER_STEPS,
    "trainer.eval_size": 16,
    "trainer.eval_every": 2,  # = checkpoint_every, so a run stopped at a checkpoint logs the same
    "trainer.checkpoint_every": 2,
}
