"""Ahead-of-time compile cases of the whole rollout program (``scripts/aot_check.py``).

One jit holds what a rollout step runs: ``quantize_params`` (the per-step FP8 weight sync, then
``fuse_projections``) and ``generate`` (prefill + ``while_loop`` decode) with W8A8 linear layers
and a static FP8 KV cache.
The model has Qwen3-8B widths but only ``NUM_LAYERS`` of its 36 layers (every layer compiles to
the same code; the label says so); its weights are ``jax.eval_shape`` of the init, so nothing is
allocated. ``IMPLS`` is the one place that picks the kernels per target.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fp8rl_jax.generation.kv import KVScales
from fp8rl_jax.generation.sampling import SamplingConfig
from fp8rl_jax.generation.static import generate
from fp8rl_jax.models import init_weights
from fp8rl_jax.models.fused import fuse_projections
from fp8rl_jax.models.presets import QWEN3_8B, QWEN3_STOP_IDS
from fp8rl_jax.quant import QuantRecipe, quantize_params
from kernels_pallas.aot import AotCase
from kernels_pallas.backend import KernelImpls

NUM_LAYERS = 2
STOP_IDS = QWEN3_STOP_IDS


@dataclasses.dataclass(frozen=True)
class RolloutShape:
    """Rows, padded prompt length and response budget of one compiled rollout program."""

    batch: int = 64  # B
    prompt_len: int = 1024  # P
    max_new_tokens: int = 3072  # N; the cache holds P + N slots


# Kernel choice per target (the decode kernel and the W8A8 matmul).
IMPLS = {
    target: KernelImpls(matmul=impl, decode_attention=impl, grouped_matmul=impl)
    for target, impl in (
        ("h100", "pallas_mosaic_gpu"),
        ("v5e", "pallas_tpu"),
        ("v6e", "pallas_tpu"),
    )
}
XLA_IMPLS = KernelImpls(matmul="xla", decode_attention="xla", grouped_matmul="xla")


def rollout_program(cfg, shape: RolloutShape, recipe, kv_cache_dtype: str, kernels: KernelImpls):
    """``(params, tokens_BP, lens_B, rng, kv_k_LK, kv_v_LK) -> Rollout``: weight sync + generate."""

    def rollout(params, tokens_BP, lens_B, rng, k_LK, v_LK):
        weights = fuse_projections(quantize_params(params, recipe), cfg)
        fp8_kv = kv_cache_dtype.startswith("float8")
        return generate(
            weights, (tokens_BP, lens_B), cfg, SamplingConfig(temperature=1.0), rng,
            kv_cache_dtype=kv_cache_dtype, kv_scale_mode="static",
            kv_scales=KVScales.of(k_LK, v_LK) if fp8_kv else None,
            max_new_tokens=shape.max_new_tokens, stop_token_ids=STOP_IDS,
            kernels=kernels,
        )  # fmt: skip

    return rollout


def rollout_args(cfg, shape: RolloutShape):
    """Abstract arguments of ``rollout_program``: BF16 params (eval_shape of the init), inputs."""
    sds = jax.ShapeDtypeStruct
    key = sds((2,), jnp.uint32)  # a raw PRNG key
    params = jax.eval_shape(functools.partial(init_weights, cfg, dtype=jnp.bfloat16), key)
    b, p, lk = shape.batch, shape.prompt_len, (cfg.num_layers, cfg.num_kv_heads)
    return (
        params,
        sds((b, p), jnp.int32),
        sds((b,), jnp.int32),
        key,
        sds(lk, jnp.float32),
        sds(lk, jnp.float32),
    )


def _label(cfg, shape: RolloutShape, kernels: KernelImpls) -> str:
    return (
        f"Qwen3-8B widths, {cfg.num_layers}/36 layers, B={shape.batch} P={shape.prompt_len} "
        f"N={shape.max_new_tokens}, W8A8 + FP8 static KV, matmul={kernels.matmul}"
    )


def cases() -> list[AotCase]:
    """quantize_params + generate (W8A8, FP8 static KV, the decode kernel) per target."""
    cfg = dataclasses.replace(QWEN3_8B, num_layers=NUM_LAYERS)
    shape, recipe = RolloutShape(), QuantRecipe()
    out = []
    for target, kernels in [*IMPLS.items(), ("h100", XLA_IMPLS)]:
        fn = rollout_program(cfg, shape, recipe, "float8_e4m3fn", kernels)
        label = _label(cfg, shape, kernels)
        case = AotCase(
            "rollout", kernels.decode_attention, target, label, fn, rollout_args(cfg, shape)
        )
        out.append(case)
    return out + paged_cases()


# The paged engine (generation/paged): page size per target = its paged kernel's tile.
PAGED_IMPLS = {
    "h100": (KernelImpls(matmul="pallas_mosaic_gpu", decode_attention="pallas_mosaic_gpu"), 64),
    "v5e": (KernelImpls(matmul="pallas_tpu", decode_attention="pallas_tpu"), 128),
}
PAGED_SLOTS = 32


def paged_rollout_program(cfg, shape: RolloutShape, recipe, kernels: KernelImpls, page_size: int,
                          slots: int = PAGED_SLOTS, precision: str = "fp8"):  # fmt: skip
    """``rollout_program`` on the paged engine: B requests over ``slots`` slots. ``precision``
    "fp8": W8A8 (``quantize_params`` + ``fuse_projections``) and FP8 static KV pages; "bf16":
    the BF16 weights and BF16 pages, the same kernels (the baseline of ``perf_model``)."""
    from fp8rl_jax.generation.config import PagedConfig
    from fp8rl_jax.generation.paged import generate_paged

    if precision not in ("fp8", "bf16"):
        raise ValueError(f"paged_rollout_program: precision must be fp8 or bf16, got {precision}")
    paged = PagedConfig(num_slots=slots, page_size=page_size, prefill_batch=4)
    fp8 = precision == "fp8"

    def rollout(params, tokens_BP, lens_B, rng, k_LK, v_LK):
        weights = fuse_projections(quantize_params(params, recipe), cfg) if fp8 else params
        return generate_paged(
            weights, (tokens_BP, lens_B), cfg, SamplingConfig(temperature=1.0), rng,
            paged=paged, kv_cache_dtype="float8_e4m3fn" if fp8 else "bfloat16",
            kv_scale_mode="static", kv_scales=KVScales.of(k_LK, v_LK) if fp8 else None,
            max_new_tokens=shape.max_new_tokens, stop_token_ids=STOP_IDS, kernels=kernels,
        )  # fmt: skip

    return rollout


def paged_cases() -> list[AotCase]:
    """quantize_params + generate_paged (W8A8, FP8 static KV pages, the paged kernel)."""
    cfg = dataclasses.replace(QWEN3_8B, num_layers=NUM_LAYERS)
    shape, recipe = RolloutShape(), QuantRecipe()
    out = []
    for target, (kernels, y) in PAGED_IMPLS.items():
        fn = paged_rollout_program(cfg, shape, recipe, kernels, y)
        label = f"{_label(cfg, shape, kernels)}, paged: {PAGED_SLOTS} slots, pages of {y}"
        args = rollout_args(cfg, shape)
        out.append(AotCase("paged_rollout", kernels.decode_attention, target, label, fn, args))
    return out
