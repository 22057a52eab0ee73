"""Rematerialization of the transformer blocks in a training forward (``jax.checkpoint``).

``none`` keeps every block's activations for the backward pass; ``block`` keeps only each block's
input and recomputes the rest of the block in the backward pass (activation memory ~ L·B·T·D
instead of ~ L·B·T·(a few D + F + H·T)); ``dots_saveable`` also keeps the outputs of the matmuls
(recomputing only the cheap elementwise ops and norms).
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Literal

import jax

Remat = Literal["none", "block", "dots_saveable"]
REMAT_POLICIES = typing.get_args(Remat)


def remat_block(block: Callable, policy: str) -> Callable:
    """``block`` wrapped in ``jax.checkpoint`` under ``policy`` (one of ``REMAT_POLICIES``)."""
    if policy == "none":
        return block
    if policy == "block":
        return jax.checkpoint(block)
    if policy == "dots_saveable":
        return jax.checkpoint(block, policy=jax.checkpoint_policies.dots_saveable)
    raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {policy!r}")
