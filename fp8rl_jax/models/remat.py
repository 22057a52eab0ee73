"""Rematerialization of the transformer blocks in a training forward (``jax.checkpoint``).

``none`` keeps every block's activations for the backward pass; ``block`` keeps only each block's
input and recomputes the rest of the block in the backward pass (activation memory ~ L·B·T·D
instead of ~ L·B·T·(a few D + F + H·T)); ``dots_saveable`` also keeps the outputs of the matmuls
(recomputing only the cheap elementwise ops and norms).

``block`` uses ``ordered_checkpoint``: each block's backward pass finishes, weight gradients
included, before the block below starts. Under ``jax.checkpoint`` XLA TPU computed every block's
input gradient first and all the weight gradients (dot + reduce-scatter loops) at the end of the
backward pass, so every block's recomputed activations (x, the [B, T, F] MLP values) stayed alive
until then: +3 GiB per Qwen3-8B layer at 2 x 10,240 tokens per device (docs/SCALING.md).
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

Remat = Literal["none", "block", "dots_saveable"]
REMAT_POLICIES = typing.get_args(Remat)


def remat_block(block: Callable, policy: str) -> Callable:
    """``block`` wrapped in ``jax.checkpoint`` under ``policy`` (one of ``REMAT_POLICIES``)."""
    if policy == "none":
        return block
    if policy == "block":
        return ordered_checkpoint(block)
    if policy == "dots_saveable":
        return jax.checkpoint(block, policy=jax.checkpoint_policies.dots_saveable)
    raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {policy!r}")


def ordered_checkpoint(fn: Callable) -> Callable:
    """``jax.checkpoint(fn)`` (keeps the inputs, recomputes ``fn`` in the backward pass) whose
    backward runs in order: the recomputation waits for the output cotangent (inputs and
    cotangent pass one ``optimization_barrier``), and the input cotangents it returns wait for
    every cotangent it returns (``_after``), the weight gradients included. The block below
    therefore starts its backward only when this block's is done, and the activations of one
    block at a time are alive. Values: those of ``jax.checkpoint`` (the tie adds an exact zero)."""

    @jax.custom_vjp
    def run(*args):
        return fn(*args)

    def run_fwd(*args):
        return fn(*args), args

    def run_bwd(args, g):
        args, g = _barrier((args, g))
        _, vjp = jax.vjp(fn, *args)
        return _after(vjp(g))

    run.defvjp(run_fwd, run_bwd)
    return run


def _floats(tree) -> list[int]:
    """Indices of the floating-point leaves of ``tree``."""
    leaves = jax.tree.leaves(tree)
    return [
        i for i, x in enumerate(leaves) if jnp.issubdtype(getattr(x, "dtype", None), jnp.inexact)
    ]


def _barrier(tree):
    """``optimization_barrier`` over the array leaves of ``tree`` (float0 cotangents pass)."""
    leaves, treedef = jax.tree.flatten(tree)
    idx = [i for i, x in enumerate(leaves) if getattr(x, "dtype", None) != jax.dtypes.float0]
    held = jax.lax.optimization_barrier([leaves[i] for i in idx])
    for i, x in zip(idx, held, strict=True):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def _after(tree):
    """``tree`` whose float leaves each depend on all of them: ``x + 0 · Σ sums``, a data
    dependency XLA keeps (``0 · s`` is not folded for floats: ``s`` may be inf or NaN). An exact
    zero for finite gradients; a non-finite gradient makes every leaf NaN (such a step is skipped
    anyway: ``rl.update``)."""
    leaves, treedef = jax.tree.flatten(tree)
    idx = _floats(leaves)
    if len(idx) < 2:
        return tree
    zero = 0.0 * sum(jnp.sum(leaves[i], dtype=jnp.float32) for i in idx)
    for i in idx:
        leaves[i] = leaves[i] + zero.astype(leaves[i].dtype)
    return jax.tree.unflatten(treedef, leaves)
