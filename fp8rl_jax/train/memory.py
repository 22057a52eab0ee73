"""Memory arithmetic of docs/SCALING.md: training state, FP8 rollout weights, KV cache."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from fp8rl_jax.models import ModelConfig, weight_shapes
from fp8rl_jax.quant import path_str
from fp8rl_jax.train.sharding.mesh import MeshConfig


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of the training state, rollout weights and KV cache (totals, before sharding)."""

    n_params: int  # all weights
    n_quantized: int  # weights in FP8 rollout matrices (attention / MLP / experts)
    master_weights: int  # FP32 master copy, 4 B/param
    optimizer_state: int  # Adam mu + nu in FP32, 8 B/param
    gradients: int  # FP32 gradients, 4 B/param
    rollout_weights: int  # FP8 matrices (1 B + 4 B per 128x128 block) + BF16 rest
    kv_bytes_per_token: int  # 2 (K and V) * L * K * C * bytes per element
    kv_cache: int  # kv_bytes_per_token * batch * seq_len

    def per_device(self, mesh_cfg: MeshConfig, num_devices: int) -> dict[str, float]:
        """GiB per device: training state over fsdp x tensor x expert, rollout over tensor
        x expert, KV cache over everything (batch over data x fsdp x expert, heads over tensor).
        Expert sharding is counted as if all weights were experts (an upper bound on savings)."""
        d, f, e, t = mesh_cfg.axis_sizes(num_devices)
        gib = 2.0**30
        train = (self.master_weights + self.optimizer_state + self.gradients) / (f * t * e)
        return {
            "train_state_gib": train / gib,
            "rollout_weights_gib": self.rollout_weights / (t * e) / gib,
            "kv_cache_gib": self.kv_cache / (d * f * e * t) / gib,
        }


def memory_estimate(
    cfg: ModelConfig,
    *,
    batch_size: int,
    seq_len: int,
    kv_cache_dtype: str = "bfloat16",
    block: int = 128,
) -> MemoryEstimate:
    """Worked memory arithmetic of docs/SCALING.md for ``cfg``.

    KV cache bytes per token ``= 2 · L · K · C · bytes`` (bytes 2 for BF16, 1 for FP8; static
    FP8 scales are per layer and head, negligible). Rollout weights: FP8 matrices take
    ``1 + 4 / block²`` bytes per element, the rest (embeddings, norms, router) stay BF16.
    """
    flat = jax.tree_util.tree_flatten_with_path(
        weight_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)
    )[0]
    n_params = n_q = 0
    for path, shape in flat:
        n = math.prod(shape)
        n_params += n
        if path_str(path).rsplit(".", 1)[-1].startswith("w"):  # wq..wo, w_gate/up/down
            n_q += n
    rollout = int(n_q * (1 + 4 / block**2)) + 2 * (n_params - n_q)
    elem = jnp.dtype(kv_cache_dtype).itemsize
    per_tok = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    return MemoryEstimate(
        n_params=n_params,
        n_quantized=n_q,
        master_weights=4 * n_params,
        optimizer_state=8 * n_params,
        gradients=4 * n_params,
        rollout_weights=rollout,
        kv_bytes_per_token=per_tok,
        kv_cache=per_tok * batch_size * seq_len,
    )
