"""A tiny RL setup shared by the scale-out workers (imported only after XLA_FLAGS is set).

Everything is f32 (weights, activations, KV cache) except the FP8 W8A8 rollout weights, so a
sharded step differs from the single-device step only by reduction order (~1e-6 relative).
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fp8rl_jax.generation import Prompts, RolloutConfig
from fp8rl_jax.models import ModelConfig, init_weights
from fp8rl_jax.quant import QuantRecipe
from fp8rl_jax.rl import RLConfig, Steps, init_train_state, jit_steps

PROMPTS, GROUP, PROMPT_LEN, NEW_TOKENS = 4, 4, 8, 4  # B = 16 rows


def model_config(kind: str) -> ModelConfig:
    common = dict(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=128, qk_norm=True)  # fmt: skip
    if kind == "dense":
        return ModelConfig(**common, architecture="Qwen3ForCausalLM")
    return ModelConfig(
        **common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        architecture="Qwen3MoeForCausalLM",
    )  # fmt: skip


def rl_configs():
    rollout = RolloutConfig(
        max_new_tokens=NEW_TOKENS, quant=QuantRecipe(), kv_cache_dtype="float32",
        compute_dtype="float32",
    )  # fmt: skip
    return rollout, RLConfig(group_size=GROUP)


def optimizer():
    # Adam's m / (sqrt(v) + eps) turns a reduction-order difference in a near-zero gradient into
    # a difference of up to 2 * lr in the update; eps = 1e-3 keeps small-gradient updates linear
    # in the gradient, so sharded vs single-device params differ only by gradient rounding.
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3, eps=1e-3, weight_decay=0.01)
    )


def programs(cfg: ModelConfig, mesh=None) -> Steps:
    """The jitted rollout and train programs: on one device, or with the mesh's shardings."""
    rollout_cfg, rl_cfg = rl_configs()
    shardings = None
    if mesh is not None:
        from fp8rl_jax.train import sharding as sh

        state = jax.eval_shape(lambda: initial_state(cfg))
        shardings = sh.step_shardings(cfg, rollout_cfg, rl_cfg, mesh, state, prompts_for(0))
    return jit_steps(cfg, rollout_cfg, rl_cfg, optimizer(), shardings=shardings)


def initial_state(cfg: ModelConfig):
    params = init_weights(cfg, jax.random.key(0), jnp.float32)
    return init_train_state(params, optimizer(), jax.random.key(1))


def prompts_np(step: int) -> tuple[np.ndarray, np.ndarray]:
    """Global prompt batch of step ``step`` (host numpy): left-padded tokens, lengths."""
    rng = np.random.default_rng(100 + step)
    lens = rng.integers(3, PROMPT_LEN + 1, size=PROMPTS)
    tokens = np.zeros((PROMPTS, PROMPT_LEN), np.int32)
    for i, n in enumerate(lens):
        tokens[i, PROMPT_LEN - n :] = rng.integers(3, 64, size=n)
    rep = lambda x: np.repeat(x, GROUP, axis=0)  # noqa: E731 (G responses per prompt)
    return rep(tokens), rep(lens).astype(np.int32)


def prompts_for(step: int) -> Prompts:
    tokens, lens = prompts_np(step)
    return Prompts(jnp.asarray(tokens), jnp.asarray(lens))


def rewards_np(tokens_BT: np.ndarray, mask_BT: np.ndarray) -> np.ndarray:
    """A host-side verifiable reward: the fraction of even response tokens."""
    even = (tokens_BT % 2 == 0) & (mask_BT > 0)
    return (even.sum(1) / np.maximum(mask_BT.sum(1), 1)).astype(np.float32)


def metrics_row(rollout_metrics, train_metrics) -> dict[str, float]:
    return {k: float(v) for k, v in {**rollout_metrics, **train_metrics}.items()}


def flat_params(params) -> dict[str, np.ndarray]:
    from fp8rl_jax.quant import path_str

    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {path_str(p): np.asarray(x) for p, x in flat}


def max_diffs(a: dict, b: dict) -> dict[str, float]:
    return {k: float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])))) for k in a}


class CompileCounter:
    """Counts XLA backend compilations (jax.monitoring event) while ``active``."""

    def __init__(self):
        self.count, self.active = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


def dump(obj, path: str | None) -> None:
    text = json.dumps(obj, indent=1, default=float)
    if path:
        with open(path, "w") as f:
            f.write(text)
    else:
        print(text)


def timer():
    t0 = time.perf_counter()
    return lambda: round(time.perf_counter() - t0, 2)
