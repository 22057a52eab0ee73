"""The page allocator: reference counts over the pool, taken and dropped in bulk on device.

A page is free iff its count is 0. ``take`` hands the i-th requester the i-th free page (in page
order), so allocation is a pure function of the counts; ``drop`` decrements (a page named twice
is decremented twice). Unneeded or unserved requests get page ``X`` (one past the pool), which
every scatter drops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8rl_jax.generation.kv import cdiv


def num_free(refs_X: jax.Array) -> jax.Array:
    return jnp.sum(refs_X == 0).astype(jnp.int32)


def take(refs_X: jax.Array, need_N: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(pages_N, refs_X'): a fresh page (count 1) for each True of ``need_N``, X elsewhere.

    Requests beyond the free pages get X too; callers check ``num_free`` first.
    """
    x, n = refs_X.shape[0], need_N.shape[0]
    free_N = jnp.nonzero(refs_X == 0, size=n, fill_value=x)[0].astype(jnp.int32)
    rank_N = jnp.cumsum(need_N.astype(jnp.int32)) - 1
    pages_N = jnp.where(need_N, free_N[jnp.clip(rank_N, 0, n - 1)], x)
    return pages_N, refs_X.at[pages_N].add(1, mode="drop")


def add(refs_X: jax.Array, pages_N: jax.Array, mask_N: jax.Array, delta: int) -> jax.Array:
    """``refs[pages[i]] += delta`` where ``mask_N[i]`` (repeated pages count repeatedly)."""
    return refs_X.at[jnp.where(mask_N, pages_N, refs_X.shape[0])].add(delta, mode="drop")


def held_UW(lengths_U: jax.Array, table_width: int, page_size: int) -> jax.Array:
    """[U, W] bool: table entry w of slot u names a page it holds (``w < cdiv(len, Y)``)."""
    n_U = cdiv(lengths_U, page_size)
    return jnp.arange(table_width, dtype=jnp.int32)[None, :] < n_U[:, None]


def drop_slots(refs_X, page_table_UW, lengths_U, slots_U, page_size: int) -> jax.Array:
    """Decrements every page held by the slots where ``slots_U`` is True."""
    held = held_UW(lengths_U, page_table_UW.shape[1], page_size) & slots_U[:, None]
    return add(refs_X, page_table_UW.reshape(-1), held.reshape(-1), -1)
