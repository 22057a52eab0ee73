"""The seam between the model and its KV caches: the protocol ``forward`` calls per layer.

``forward`` knows no cache type and no attention kernel. It calls ``cache.prepare(valid_BT,
kernels)`` once per call; the returned ``CacheStep`` gives the new tokens' default positions,
``attend(layer, q, k, v, sm_scale, quant_out)`` per layer (write this layer's new K/V, attend over
the cache with the cache's own kernel, return the output and the layer's new buffers) and, after the
last layer, ``advance(writes)``: the cache after the call. The caches live in ``generation.kv``
(``dense``: one row per sequence; ``paged``: a page pool and page tables). Without a cache
``forward`` attends causally within segments (training, scoring, calibration).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from kernels_pallas.backend import KernelImpls
from kernels_pallas.qarray import QArray


class CacheStep(Protocol):
    """One ``forward`` call's view of a cache (built by ``Cache.prepare``)."""

    positions_BT: jax.Array  # int32: the new tokens' positions when the caller gives none

    def attend(
        self, layer: int, q_BTHC: jax.Array, k_BTKC: jax.Array, v_BTKC: jax.Array,
        sm_scale: float, quant_out=None,
    ) -> tuple[jax.Array | QArray, Any]:  # fmt: skip
        """(attention output [B, T, H, C], this layer's buffers after writing k and v).

        ``quant_out`` (an FP8 dtype, asked for when the o_proj is W8A8): the cache may instead
        return the output quantized as the o_proj reads it, a QArray ``[B·T, H·C]`` in 1x128
        groups (its kernel's epilogue: one launch fewer), or keep it plain.
        """
        ...

    def advance(self, writes: list) -> Cache:
        """The cache after the call, from every layer's ``attend`` buffers (in layer order)."""
        ...


class Cache(Protocol):
    """A KV cache ``forward`` can run over (a pytree: it is carried through ``jit`` loops)."""

    def prepare(self, valid_BT: jax.Array, kernels: KernelImpls) -> CacheStep:
        """The step for T new tokens per row (``valid_BT``: real tokens; pads are not kept)."""
        ...
