"""``quantize_params``: the per-step weight sync, a leaf swap Array -> QArray inside the program."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

from fp8rl_jax.quant.recipe import QuantRecipe
from kernels_pallas.qarray import QArray
from kernels_pallas.quantize import quantize_weight

_LAYER_RE = re.compile(r"layers[./\[']+(\d+)")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantStats:
    """What ``quantize_params`` did: counts computed on device (usable under jit)."""

    nonfinite: jax.Array  # number of NaN/Inf entries in the weights that were quantized
    n_quantized: int = dataclasses.field(metadata=dict(static=True))  # leaves turned into QArray
    n_kept: int = dataclasses.field(metadata=dict(static=True))  # matrices kept high precision


def path_str(path) -> str:
    """'layers.3.attn.wq' style name of a pytree path (dict keys, list indices, attributes)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        else:
            parts.append(str(k))
    return ".".join(parts)


def _num_layers(names: list[str]) -> int:
    idx = [int(m.group(1)) for n in names if (m := _LAYER_RE.search(n))]
    return max(idx) + 1 if idx else 0


def should_quantize(name: str, leaf, recipe: QuantRecipe, n_layers: int) -> bool:
    """True for a floating weight of rank >= 2 not excluded by pattern or first/last-N layers."""
    if isinstance(leaf, QArray) or not hasattr(leaf, "ndim") or leaf.ndim < 2:
        return False
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
        return False
    if any(re.search(p, name) for p in recipe.exclude):
        return False
    m = _LAYER_RE.search(name)
    if m is not None:
        i = int(m.group(1))
        if i < recipe.keep_first_n or i >= n_layers - recipe.keep_last_n:
            return False
    return True


def _quantize_leaf(name: str, w_KN: jax.Array, recipe: QuantRecipe) -> QArray:
    """Training weight [..., K, N] -> rollout QArray [..., N, K] (K-major, ``quantize_weight``)."""
    block = w_KN.shape[-2:] if recipe.per_tensor else recipe.weight_block
    try:  # eagerly, quantize_blockwise rejects NaN/Inf; name the weight in the error
        return quantize_weight(w_KN, block, recipe.dtype, pow2_scales=recipe.pow2_scales)
    except ValueError as e:
        raise ValueError(f"quantize_params: weight {name!r}: {e}") from None


def quantize_params(params, recipe: QuantRecipe | None, *, return_stats: bool = False):
    """Replaces linear-layer weights with blockwise FP8 QArrays (DESIGN.md §4.2, §4.4).

    Each quantized ``[..., K, N]`` weight becomes a QArray ``[..., N, K]`` (the K-major layout the
    FP8 kernels need; the transpose is fused into this pass, which reads and writes every weight
    anyway). Weights that are kept stay as they are.

    Runs inside jit (the per-step weight sync). Eagerly, NaN/Inf weights raise a ValueError;
    under jit they are counted in ``QuantStats.nonfinite`` (``return_stats=True``).
    ``recipe=None`` returns the params unchanged (BF16 rollout).
    """
    if recipe is None:
        stats = QuantStats(jnp.zeros((), jnp.int32), 0, 0)
        return (params, stats) if return_stats else params
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, QArray)
    )
    names = [path_str(p) for p, _ in flat]
    n_layers = _num_layers(names)
    out, nonfinite, n_q, n_kept = [], jnp.zeros((), jnp.int32), 0, 0
    for name, (_, leaf) in zip(names, flat, strict=True):
        if should_quantize(name, leaf, recipe, n_layers):
            nonfinite = nonfinite + jnp.sum(~jnp.isfinite(leaf)).astype(jnp.int32)
            out.append(_quantize_leaf(name, leaf, recipe))
            n_q += 1
        else:
            n_kept += int(hasattr(leaf, "ndim") and leaf.ndim >= 2)
            out.append(leaf)
    new = jax.tree_util.tree_unflatten(treedef, out)
    return (new, QuantStats(nonfinite, n_q, n_kept)) if return_stats else new
