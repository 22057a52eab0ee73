"""In-cluster split-K for the Hopper fp8_matmul (``MgpuConfig.cluster_k``, the decode default at
2 K chunks): the K chunks of a swap-AB tile run as one CTA cluster, and each compute warpgroup's
f32 accumulator is summed inside the cluster instead of by an XLA fusion over f32 partials.

The tile of warpgroup ``wg`` is summed by the cluster's CTA ``wg % split`` (``cluster_roles``:
a CTA sums at most ceil(nwg / split) tiles); the other chunks' warpgroups send theirs over the
SM-to-SM network into its SMEM (``plgpu.async_store_smem``: ``st.async``, each thread completing
its share of the bytes on the owner's mbarrier, so the barrier counts one warpgroup arrival per
store), and the owner adds them in f32 (its own chunk first, then the others in chunk order)
and writes the finished tile through the kernel's ordinary epilogue (y for 16-bit outputs). No
f32 partials in HBM and no XLA sum after the kernel: a standalone call is one launch
(FlashDecoding-style split reductions, here through distributed shared memory).

GPU interpret mode has no DSMEM store, so there (``emulate``) the chunks pass through a GMEM
buffer (an extra kernel output, ``emulation_buffer``) and a cluster barrier into the owner's
SMEM slot: the same roles, slots, summation order and store as on the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.fp8_matmul.mgpu_config import _WGMMA_M  # a warpgroup accumulator's rows


def cluster_roles(k_part, wg, split: int):
    """(owner, slot) of K chunk ``k_part`` of warpgroup ``wg``'s tile: the tile is summed by the
    cluster's CTA ``owner = wg % split``; every other chunk sends its accumulator into the
    owner's SMEM slot ``slot`` (0 .. split - 2). Plain ints or traced scalars."""
    owner = wg % split
    return owner, k_part - jnp.where(k_part > owner, 1, 0)


def scratch(split: int, nwg: int, cols: int, transforms, emulate: bool) -> dict:
    """The SMEM a CTA needs: ``red_smem``, the received f32 accumulators ``[split - 1, nwg, 64,
    cols]``; ``red_bar``, per compute warpgroup the barrier counting the stores into them (in
    interpret mode one per received chunk's GMEM -> SMEM copy); ``sent_bar`` (interpret mode),
    a barrier over the cluster's compute warpgroups: every chunk is in GMEM once it completes."""
    red_smem = plgpu.SMEM((split - 1, nwg, _WGMMA_M, cols), jnp.float32, transforms=transforms)
    if emulate:
        red_bar = plgpu.Barrier(num_barriers=(split - 1, nwg))
        sent_bar = plgpu.ClusterBarrier(collective_axes=("s",), num_arrivals=nwg)
    else:
        red_bar, sent_bar = plgpu.Barrier(num_arrivals=split - 1, num_barriers=nwg), None
    return dict(red_smem=red_smem, red_bar=red_bar, sent_bar=sent_bar)


def emulation_buffer(tiles_a: int, tiles_b: int, split: int, nwg: int, cols: int):
    """Interpret mode's GMEM stand-in for the SM-to-SM network: one f32 accumulator per tile,
    sent chunk slot and compute warpgroup."""
    shape = (tiles_a, tiles_b, split - 1, nwg, _WGMMA_M, cols)
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def sum_chunks(acc, store, *, k_part, wg, split: int, red_smem, red_bar, sent_bar, red_tile):
    """Sums warpgroup ``wg``'s chunk accumulators ``acc`` over the cluster; the owner calls
    ``store(total)``. ``red_tile``: this tile's ``emulation_buffer`` view (interpret mode), else
    None."""
    owner, slot = cluster_roles(k_part, wg, split)
    emulate = red_tile is not None

    @pl.when(k_part != owner)
    def _send():
        if emulate:
            red_smem[slot, wg] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(red_smem.at[slot, wg], red_tile.at[slot, wg])
            plgpu.wait_smem_to_gmem(0)
        else:
            plgpu.async_store_smem(acc, red_smem.at[slot, wg], red_bar.at[wg],
                                   cluster_idx=owner, cluster_dim="s")  # fmt: skip

    if emulate:
        plgpu.barrier_arrive(sent_bar)
        plgpu.barrier_wait(sent_bar)

    @pl.when(k_part == owner)
    def _sum():
        if emulate:
            for j in range(split - 1):
                plgpu.copy_gmem_to_smem(red_tile.at[j, wg], red_smem.at[j, wg], red_bar.at[j, wg])
                plgpu.barrier_wait(red_bar.at[j, wg])
        else:
            plgpu.barrier_wait(red_bar.at[wg])
        total = acc
        for j in range(split - 1):
            total = total + red_smem[j, wg]
        store(total)
