"""Ahead-of-time compile cases of ``grouped_matmul`` at Qwen3-30B-A3B training shapes
(``aot_check.py``): the forward and both gradients (one program: ``jax.vjp``) of the expert
stacks as the BF16 training pass runs them under expert = 8 (16 local experts).

Rows: one dispatch chunk of 4,096 gathered tokens at top-8 (32,768 rows, ~1/8 of them live on a
shard) and a small one of 1,024 tokens; gate/up ``[16, 2048, 768]`` and down ``[16, 768, 2048]``.
The H100 ``xla`` case is the dense expansion these kernels replace (compiled for comparison).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.aot import AotCase
from kernels_pallas.grouped_matmul.api import grouped_matmul

E_LOCAL, D, F, TOP_K = 16, 2048, 768, 8
LAYERS = (("gate/up", D, F), ("down", F, D))
ROWS = (1024 * TOP_K, 4096 * TOP_K)


def _fwd_bwd(x, w, gs, *, impl: str):
    y, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, impl=impl), x, w)
    return y, *vjp(y)


def _case(impl: str, layer: str, k: int, n: int, rows: int) -> AotCase:
    sds = jax.ShapeDtypeStruct
    args = (sds((rows, k), jnp.bfloat16), sds((E_LOCAL, k, n), jnp.bfloat16),
            sds((E_LOCAL,), jnp.int32))  # fmt: skip
    label = f"Qwen3-30B-A3B {layer} E/8={E_LOCAL} K={k} N={n} rows={rows} (train fwd+bwd)"
    fn = functools.partial(_fwd_bwd, impl=impl)
    return AotCase("grouped_matmul", impl, "h100", label, fn, args)


def cases() -> list[AotCase]:
    out = [_case("pallas_mosaic_gpu", *layer, rows) for layer in LAYERS for rows in ROWS]
    return out + [_case("xla", *LAYERS[0], ROWS[0])]
