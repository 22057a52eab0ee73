"""Ahead-of-time compile cases of the FP8 MoE layer of a rollout (``scripts/aot_check.py``).

One Qwen3-30B-A3B MoE block (E=128, top-8, D=2048, F=768) as the rollout runs it: the per-step
weight sync (``quantize_params`` of the BF16 expert stacks) and ``moe_mlp`` (f32 router, gate+up
in one grouped FP8 GEMM, down) over a decode step of 64 sequences and a prefill chunk of 1024
tokens, for each target's grouped kernel. A ``pallas_*`` case fails unless the compiled program
holds the Pallas kernels, so these prove the rollout's experts reach the kernel at real shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.moe import moe_mlp
from fp8rl_jax.models.presets import QWEN3_30B_A3B
from fp8rl_jax.models.weights import param_specs
from fp8rl_jax.quant import QuantRecipe, quantize_params
from kernels_pallas.aot import AotCase
from kernels_pallas.backend import KernelImpls

TOKENS = (("decode", 64, 1), ("prefill", 1, 1024))  # (phase, B, T)
IMPLS = {"h100": "pallas_mosaic_gpu", "v5e": "pallas_tpu", "v6e": "pallas_tpu"}


def _moe_block(mlp_params, x_BTD, cfg: ModelConfig, impl: str):
    rollout = quantize_params({"layers": [{"mlp": mlp_params}]}, QuantRecipe())
    p = rollout["layers"][0]["mlp"]
    valid = jnp.ones(x_BTD.shape[:2], bool)
    return moe_mlp(p, x_BTD, valid, cfg, KernelImpls(grouped_matmul=impl))[0]


def _args(cfg: ModelConfig, b: int, t: int):
    specs = param_specs(cfg)["layers"][0]["mlp"]
    mlp = {k: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16) for k, s in specs.items()}
    return mlp, jax.ShapeDtypeStruct((b, t, cfg.hidden_size), jnp.bfloat16)


def cases() -> list[AotCase]:
    """The MoE block at decode and prefill token counts, per target (plus the XLA path)."""
    cfg = QWEN3_30B_A3B
    out = []
    for target, impl in [*IMPLS.items(), ("h100", "xla")]:
        for phase, b, t in TOKENS:
            fn = functools.partial(_moe_block, cfg=cfg, impl=impl)
            label = f"Qwen3-30B-A3B MoE block, weight sync + moe_mlp, B={b} T={t} ({phase})"
            out.append(AotCase("moe_mlp", impl, target, label, fn, _args(cfg, b, t)))
    return out
