"""Expert parallelism for the MoE layer: each ``expert`` shard runs only its own E/n experts.

Under plain GSPMD the expert stacks ``[E, ...]`` are split over the ``expert`` mesh axis, but a
custom kernel (``pallas_call``) is not partitioned by GSPMD: the grouped FP8 GEMM would gather
every expert to every device. So when the installed mesh (``jax.set_mesh``) has ``expert > 1``
the dispatch -> experts -> combine steps of ``moe.moe_mlp`` run inside ``jax.shard_map`` with
every mesh axis manual (routing stays outside, under GSPMD):

  1. ``all_gather`` over ``expert`` of the shard's tokens (the FP8 rollout gathers the 1x128
     quantized activations, 1 byte/value + scales) and of their top-k ids and weights;
  2. ``local_dispatch``: the (token, expert) assignments whose expert lives on this shard, sorted
     by local expert; the other rows sort past ``Σ group_sizes`` (a fixed buffer of all n·N·k
     rows, of which the grouped GEMMs compute only the live ones);
  3. the shard's experts ``[E/n, ...]`` through ``experts.experts`` (the grouped kernel or
     ``ragged_dot``), combined into a partial output for all n·N gathered tokens;
  4. ``psum_scatter`` over ``expert``: each token's sum over all experts, back on its own shard.

Steps 2-3 run over chunks of at most ``TOKEN_CHUNK`` gathered tokens (``dispatch_chunk``: fewer
for BF16 experts that XLA:GPU runs, as it expands ``ragged_dot`` densely; ``lax.map``, each chunk
rematerialized in a backward pass): the dispatch buffers hold n·N·k rows, so Qwen3-30B-A3B's
scoring of 8 rows x 10K tokens per device over expert = 8 would otherwise sort 5.2M rows of
2,048 values per layer (~21 GB, and the SwiGLU intermediates after it).

Why all-gather + reduce-scatter rather than an all-to-all of routed rows: with top-k routing
each token's row goes to up to k shards, so the all-to-all moves ~k·N·D(n-1)/n values per shard
each way and, being dropless with static shapes, needs receive buffers sized for the worst case
(n·N·k rows per shard, n times the average); the all-gather moves (n-1)·N·D, less than the
all-to-all's average whenever n <= k (Qwen3-30B-A3B: k = 8, EP <= 8 within a node), has no
capacity question, and its transpose (reduce-scatter) makes the training backward pass free of
hand-written collectives. Both programs (FP8 rollout, BF16 training forward and its gradient)
use the same code.

Other axes: tokens stay split over the batch axes (``data``/``fsdp``/``expert``, as far as they
divide the token count); the expert stacks enter split over ``expert`` only, so training's FSDP
shards are all-gathered at the layer (the backward reduce-scatters them) and a ``tensor`` axis
computes the experts replicated (no tensor parallelism inside the experts yet).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fp8rl_jax.models.experts import Dispatch, combine, dispatch, experts
from fp8rl_jax.models.rows import dividing_axes
from fp8rl_jax.quant import TrainQWeight
from kernels_pallas.backend import DEFAULT_KERNELS, KernelImpls
from kernels_pallas.grouped_matmul import IMPLEMENTATIONS as GROUPED_MATMUL
from kernels_pallas.qarray import QArray
from kernels_pallas.quantize import quantize_activations

EXPERT_AXIS = "expert"


def expert_mesh(num_experts: int):
    """The installed abstract mesh if it splits experts (``expert`` > 1 dividing E), else None.

    None too inside a ``shard_map`` over ``expert`` (a manual axis: each shard holds whole
    expert stacks there, e.g. the paged engine's per-shard engines)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names or EXPERT_AXIS in mesh.manual_axes:
        return None
    n = mesh.shape[EXPERT_AXIS]
    return mesh if n > 1 and num_experts % n == 0 else None


def local_dispatch(top_i_NK: jax.Array, first: jax.Array, num_local: int) -> Dispatch:
    """``dispatch`` of the assignments to experts ``first .. first + num_local - 1`` only.

    Their rows come first, sorted by local expert ``e - first``; all other rows follow (key
    ``num_local``) and are left out of ``group_sizes_E`` ([num_local]), so the grouped GEMMs
    return zeros for them.
    """
    local = (top_i_NK >= first) & (top_i_NK < first + num_local)
    d = dispatch(jnp.where(local, top_i_NK - first, num_local), num_local + 1)
    return Dispatch(d.order_R, d.token_R, d.group_sizes_E[:num_local])


TOKEN_CHUNK = 4096  # gathered tokens per dispatch: buffers of at most TOKEN_CHUNK·k rows
# XLA:GPU lowers ``jax.lax.ragged_dot`` (the BF16 experts: scoring and training) densely over the
# groups: every row times every local expert, ``[E/n, rows, D]`` buffers (f32 in the backward).
# At TOKEN_CHUNK = 4,096, Qwen3-30B-A3B at expert = 8 holds several of 16 x 32,768 x 2,048 f32
# = 4 GiB each (its train program on 8xH100 compiled to 23 GiB of temporaries at 4 layers,
# 11 GiB with chunks of 1,024). So on GPU the BF16 path's chunk keeps that buffer <= this.
GPU_DENSE_RAGGED_BYTES = 2**30


def num_token_chunks(n_tokens: int, chunk: int | None = None) -> int:
    """The fewest equal chunks of at most ``chunk`` (default ``TOKEN_CHUNK``) tokens that
    ``n_tokens`` splits into (a divisor of ``n_tokens``; 1 when it is no more than ``chunk``)."""
    chunk = TOKEN_CHUNK if chunk is None else chunk
    for c in range(-(-n_tokens // chunk), n_tokens + 1):
        if n_tokens % c == 0:
            return c
    return n_tokens


def dispatch_chunk(platform: str | None, w_gate, num_local: int, k: int,
                   kernels: KernelImpls = DEFAULT_KERNELS) -> int:  # fmt: skip
    """Gathered tokens per dispatch chunk: ``TOKEN_CHUNK``, or on ``platform`` "gpu" for BF16
    experts that XLA runs (``ragged_dot``, ``w_gate`` [E, D, F]: no Hopper kernel for them, e.g.
    f32 weights or ``expert_matmul="xla"``) the most that keeps XLA:GPU's dense
    ``[num_local, chunk·k, D]`` f32 buffer within ``GPU_DENSE_RAGGED_BYTES``. FP8 experts and
    ``grouped_matmul``'s Hopper kernels hold ``[chunk·k, D]`` buffers: ``TOKEN_CHUNK``."""
    if platform != "gpu" or isinstance(w_gate, (QArray, TrainQWeight)):
        return TOKEN_CHUNK
    sds = jax.ShapeDtypeStruct
    rows, (_, d, f) = TOKEN_CHUNK * k, w_gate.shape
    operands = (sds((rows, d), w_gate.dtype), sds((num_local, d, f), w_gate.dtype),
                sds((num_local,), jnp.int32))  # fmt: skip
    chosen = GROUPED_MATMUL.select(kernels.expert_matmul, *operands, config=None,
                                   interpret=kernels.interpret)  # fmt: skip
    if chosen.name != "xla":
        return TOKEN_CHUNK
    per_token = num_local * k * d * 4
    return max(1, min(TOKEN_CHUNK, GPU_DENSE_RAGGED_BYTES // per_token))


def _shard_body(p, x_ND, top_w_NK, top_i_NK, *, num_local: int, gathered: bool, kernels,
                chunk: int):  # fmt: skip
    """One shard: its tokens (gathered over ``expert`` if split) through its own experts."""
    if isinstance(p["w_gate"], QArray):  # quantize per token before gathering: FP8 on the wire
        x_ND = quantize_activations(x_ND, p["w_gate"].block_shape[1], p["w_gate"].values.dtype)
    if gathered:
        x_ND, top_w_NK, top_i_NK = jax.lax.all_gather(
            (x_ND, top_w_NK, top_i_NK), EXPERT_AXIS, tiled=True
        )
    first = jax.lax.axis_index(EXPERT_AXIS) * num_local

    def local(x_CD, top_w_CK, top_i_CK):  # C tokens through this shard's experts
        d = local_dispatch(top_i_CK, first, num_local)
        local_w = jnp.where((top_i_CK >= first) & (top_i_CK < first + num_local), top_w_CK, 0.0)
        return combine(experts(p, x_CD, d, kernels), local_w, d)

    N = top_i_NK.shape[0]
    n_chunks = num_token_chunks(N, chunk)
    if n_chunks == 1:
        y_ND = local(x_ND, top_w_NK, top_i_NK)
    else:  # bounded dispatch buffers; the backward keeps only each chunk's inputs
        split = jax.tree.map(
            lambda a: a.reshape(n_chunks, N // n_chunks, *a.shape[1:]), (x_ND, top_w_NK, top_i_NK)
        )
        y_ND = jax.lax.map(lambda a: jax.checkpoint(local)(*a), split).reshape(N, -1)
    if gathered:
        return jax.lax.psum_scatter(y_ND, EXPERT_AXIS, scatter_dimension=0, tiled=True)
    return jax.lax.psum(y_ND, EXPERT_AXIS)


def expert_parallel_mlp(p, x_ND, top_w_NK, top_i_NK, mesh, kernels: KernelImpls):
    """``combine(experts(p, x, dispatch(top_i)), top_w)`` [N, D] with experts split over the mesh.

    Same result as the single-device steps up to summation order (each token's k expert rows
    are summed per shard, then across shards).
    """
    n = mesh.shape[EXPERT_AXIS]
    axes = dividing_axes(dict(mesh.shape), x_ND.shape[0])  # the tokens' batch axes
    tok = P(axes or None)
    experts_p = {k: v for k, v in p.items() if k != "router"}
    num_local = p["w_gate"].shape[0] // n
    device = getattr(mesh, "abstract_device", None)
    body = functools.partial(
        _shard_body,
        num_local=num_local,
        gathered=EXPERT_AXIS in axes,
        kernels=kernels,
        chunk=dispatch_chunk(
            getattr(device, "platform", None), p["w_gate"], num_local, top_i_NK.shape[1], kernels
        ),
    )
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(EXPERT_AXIS), tok, tok, tok),
        out_specs=tok,
    )(experts_p, x_ND, top_w_NK, top_i_NK)
