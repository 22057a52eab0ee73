"""Rows stay split over the batch axes of the installed mesh (a sharding hint, no math).

The model code carries no shardings (``train.sharding``: ``AxisType.Auto``, GSPMD/Shardy
propagation). Propagation loses the batch split where nothing pins it: through a gather
(the minibatch shuffle), a reshape (the micro-batch cut) and into the backward pass of a
rematerialized block, XLA may pick "replicated" and every device then computes every row
(8x the activations at fsdp=8). ``constrain_rows`` pins the rows axis of an array to the mesh's
batch axes there. Without an installed mesh, or for axes a ``shard_map`` made manual, it is the
identity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp", "expert")  # the mesh axes rows are split over (train.sharding)


def dividing_axes(sizes: Mapping[str, int], rows: int, axes=BATCH_AXES) -> tuple[str, ...]:
    """The longest prefix of ``axes`` (those in ``sizes`` with size > 1) whose product of
    sizes divides ``rows``: the axes ``rows`` rows split evenly over."""
    out: tuple[str, ...] = ()
    for a in (a for a in axes if sizes.get(a, 1) > 1):
        if rows % (math.prod(sizes[b] for b in out) * sizes[a]):
            break
        out += (a,)
    return out


def row_axes(rows: int) -> tuple[str, ...]:
    """``dividing_axes`` over the installed mesh's automatic ``BATCH_AXES``; () without a
    mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    auto = set(mesh.auto_axes)
    return dividing_axes({a: n for a, n in mesh.shape.items() if a in auto}, rows)


def constrain_rows(tree, axis: int = 0):
    """Every array leaf of ``tree`` with its ``axis`` split over ``row_axes``, the rest
    replicated; the identity where there are no such axes."""

    def one(x):
        axes = row_axes(x.shape[axis])
        if not axes:
            return x
        spec = [None] * x.ndim
        spec[axis] = axes
        return jax.lax.with_sharding_constraint(x, P(*spec))

    return jax.tree.map(one, tree)
