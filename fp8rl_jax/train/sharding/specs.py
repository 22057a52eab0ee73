"""Logical-axis rules and the shardings of weights, train state, batches and KV cache (§6).

Each weight dim has a logical name (``models.logical_axes``); ``ShardingRules`` map names to mesh
axes. ``TRAIN_RULES`` also shard the largest still-unsharded dim of every matrix over ``fsdp`` (and
``expert``, unless the matrix is an expert stack already split on it);
``ROLLOUT_RULES`` keep weights whole across ``data``/``fsdp`` (the generator needs them every
decode step) and split the batch there instead. Switching phase is a reshard inside the rollout
program: its weights come in FSDP-sharded and XLA all-gathers each one where it is used.

Divisibility: a dim sharded over axes (a1, a2, ...) keeps the longest prefix whose size product
divides it (counted in heads for flattened head dims, so TP never splits a head); the dropped
axes replicate that dim, logged once per weight. Nothing is left for XLA to fail on.

QArray weights are stored ``[.., out, in]`` (K-major) and shard like the ``[.., in, out]`` weight
they quantize, dims swapped. Their scales (``[.., ceil(out/b), ceil(in/b)]``): a blocked scale dim
takes the mesh axes of its values dim iff every values shard holds whole blocks,
``(dim / n) % b == 0``; then scale shard i covers exactly values shard i and quantization needs no
communication. Otherwise that scale dim is replicated (it is 1/b of the values' size).

Batches: the fields a dataclass declares ``fields.batched()`` split their leading (row) axis over
the batch axes; everything else is replicated.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp8rl_jax.fields import is_batched
from fp8rl_jax.models import ModelConfig, logical_axes
from fp8rl_jax.models.fused import fused_axes
from fp8rl_jax.quant import QArray, path_str
from fp8rl_jax.train.sharding.mesh import mesh_sizes

log = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axes; ``fsdp``: axes for the largest unsharded matrix dim."""

    logical: tuple[tuple[str, tuple[str, ...]], ...]
    fsdp: tuple[str, ...] = ()

    def mesh_axes(self, name: str | None) -> tuple[str, ...]:
        return dict(self.logical).get(name, ()) if name else ()

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return self.mesh_axes("batch")


_BATCH = ("data", "fsdp", "expert")
_TP = (
    ("q_heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("qkv_groups", ("tensor",)),  # fused rollout q|k|v (``models.fused``), whole KV groups
    ("mlp_pairs", ("tensor",)),  # fused rollout gate|up, whole (gate, up) block pairs
    ("vocab", ("tensor",)),
    ("experts", ("expert",)),
)
# Training: FSDP over `fsdp`, and over `expert` for weights that are not experts (ZeRO-3 over
# the expert axis, as it is data parallel for dense layers) + TP/EP; rollout: weights whole
# across data/fsdp (batch split there instead).
TRAIN_RULES = ShardingRules(logical=(("batch", _BATCH), *_TP), fsdp=("fsdp", "expert"))
ROLLOUT_RULES = ShardingRules(logical=(("batch", _BATCH), *_TP), fsdp=())


def _fit(dim: int, unit: int, axes, sizes, where: str) -> tuple[str, ...]:
    """Longest prefix of ``axes`` whose size product divides ``dim / unit`` (whole units)."""
    count = dim // unit if dim % unit == 0 else dim
    kept: tuple[str, ...] = ()
    for a in axes:
        if count % (math.prod(sizes[x] for x in kept) * sizes[a]):
            break
        kept += (a,)
    if kept != tuple(axes):
        shape = {a: sizes[a] for a in axes}
        _warn_once(
            f"sharding: {where}: size {dim} (unit {unit}) does not divide mesh axes {shape}; "
            f"sharded over {kept or 'nothing'}, replicated over the rest"
        )
    return kept


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def spec_for(shape, names, sizes, rules: ShardingRules, where: str = "", units=None) -> list:
    """Per-dim mesh-axes tuples of one array with logical ``names``, under ``rules``."""
    units = units or (1,) * len(shape)
    used: set[str] = set()
    spec = []
    for i, (dim, name) in enumerate(zip(shape, names, strict=True)):
        axes = [a for a in rules.mesh_axes(name) if sizes.get(a, 1) > 1 and a not in used]
        kept = _fit(dim, units[i], axes, sizes, f"{where}[{i}:{name}]") if axes else ()
        used.update(kept)
        spec.append(kept)
    fsdp = tuple(a for a in rules.fsdp if sizes.get(a, 1) > 1 and a not in used)
    if fsdp and len(shape) >= 2:
        _place_fsdp(spec, shape, names, fsdp, sizes, where)
    return spec


def _place_fsdp(spec: list, shape, names, fsdp: tuple[str, ...], sizes, where: str) -> None:
    """Shards the largest free dim over the longest prefix of ``fsdp`` that divides it.

    A ``vocab`` dim comes last: the embedding gradient is a scatter-add over vocab rows, which
    XLA cannot partition along a sharded vocab dim (it would replicate the table).
    """
    free = [i for i in range(len(shape)) if not spec[i]]
    free.sort(key=lambda i: (names[i] == "vocab", -shape[i]))
    for k in range(len(fsdp), 0, -1):
        n = math.prod(sizes[a] for a in fsdp[:k])
        pick = next((i for i in free if shape[i] % n == 0), None)
        if pick is not None:
            spec[pick] = fsdp[:k]
            if k < len(fsdp):
                _warn_once(f"sharding: {where}: {tuple(shape)} sharded over {fsdp[:k]} of {fsdp}")
            return
    _warn_once(f"sharding: {where}: no dim of {tuple(shape)} divides {fsdp}; replicated")


def _swap_last2(t):
    return (*t[:-2], t[-1], t[-2])


def _logical_shape(leaf) -> tuple[int, ...]:
    """The training-layout shape a leaf's logical names describe: a QArray weight is stored
    ``[.., N, K]`` (K-major, ``quantize_weight``) for names of the ``[.., K, N]`` weight."""
    if isinstance(leaf, QArray) and len(leaf.block_shape) == 2:
        return _swap_last2(tuple(leaf.shape))
    return tuple(leaf.shape)


def _qarray_spec(q, names, sizes, rules, where, units):
    """(values spec, scales spec): the values shard like the ``[.., K, N]`` weight they quantize
    (its spec with the last two dims swapped, so quantizing needs no communication); a scale dim
    shares its values dim's axes iff block-aligned."""
    v = spec_for(_logical_shape(q), names, sizes, rules, where, units)
    v = _swap_last2(v) if len(q.block_shape) == 2 else v
    lead = q.values.ndim - len(q.block_shape)
    s = list(v[:lead])
    for j, b in enumerate(q.block_shape):
        dim, axes = q.values.shape[lead + j], v[lead + j]
        n = math.prod(sizes[a] for a in axes)
        if axes and (dim // n) % b:
            _warn_once(
                f"sharding: {where}: scales dim {lead + j} replicated (a shard of {dim // n} "
                f"is not a whole number of {b}-blocks)"
            )
            axes = ()
        s.append(axes)
    return v, s


def _units(cfg: ModelConfig, names, shape, leaf=None) -> tuple[int, ...]:
    """Flattened head dims [H*C] / [K*C] count in heads, so TP never splits a head; the fused
    rollout weights (``models.fused``) count in whole KV groups (G+2 heads) and whole gate/up
    block pairs, so a shard holds exactly the rows of the separate weights' shards."""
    heads = {"q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads}
    group = (cfg.num_heads // cfg.num_kv_heads + 2) * cfg.head_dim
    pair = 2 * leaf.block_shape[0] if isinstance(leaf, QArray) else 2

    def unit(n, d):
        if n in heads and d == heads[n] * cfg.head_dim:
            return cfg.head_dim
        return {"qkv_groups": group, "mlp_pairs": pair}.get(n, 1)

    return tuple(unit(n, d) for n, d in zip(names, shape, strict=True))


def param_specs(weights, cfg: ModelConfig, mesh, rules: ShardingRules):
    """PartitionSpecs of a weights pytree (arrays, ShapeDtypeStructs or QArrays)."""
    sizes = mesh_sizes(mesh)

    def one(path, names, leaf):
        where = path_str(path)
        units = _units(cfg, names, _logical_shape(leaf), leaf)
        if isinstance(leaf, QArray):
            v, s = _qarray_spec(leaf, names, sizes, rules, where, units)
            return QArray(P(*map(_entry, v)), P(*map(_entry, s)), leaf.block_shape, leaf.dtype)
        return P(*map(_entry, spec_for(leaf.shape, names, sizes, rules, where, units)))

    axes = fused_axes(logical_axes(cfg), weights)
    try:
        return jax.tree_util.tree_map_with_path(
            one, axes, weights, is_leaf=lambda x: isinstance(x, tuple)
        )
    except (ValueError, TypeError) as e:
        raise ValueError(
            "param_specs: the weights pytree does not match models.logical_axes(cfg) "
            f"(same dict/list structure, one array or QArray per weight): {e}"
        ) from e


def _named(mesh, spec_tree):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree, is_leaf=_is_spec)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def param_shardings(weights, cfg: ModelConfig, mesh, rules: ShardingRules):
    """NamedShardings of a weights pytree; QArray leaves get a QArray of (values, scales)."""
    return _named(mesh, param_specs(weights, cfg, mesh, rules))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def mirror_params(tree, params, params_sharding, mesh):
    """Shardings for a pytree (e.g. optax state) whose params-shaped subtrees mirror the params.

    A subtree with the params' tree structure and leaf shapes takes ``params_sharding``; every
    other leaf (step counts, scalars) is replicated.
    """
    p_def = jax.tree.structure(params)
    p_shapes = [tuple(x.shape) for x in jax.tree.leaves(params)]

    def is_params(x) -> bool:
        if jax.tree.structure(x) != p_def:
            return False
        return [tuple(getattr(y, "shape", ())) for y in jax.tree.leaves(x)] == p_shapes

    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_params)
    repl = replicated(mesh)
    out = [params_sharding if is_params(x) else repl for x in leaves]
    return jax.tree.unflatten(treedef, out)


def train_state_shardings(state, cfg: ModelConfig, mesh, rules: ShardingRules = TRAIN_RULES):
    """Shardings of an ``rl.TrainState`` (concrete or from ``jax.eval_shape``).

    params by ``rules``; optimizer state and the frozen reference policy (if any) mirror them;
    the value head, KV scales, step, RNG and counters are replicated.
    """
    ps = param_shardings(state.params, cfg, mesh, rules)
    base = jax.tree.map(lambda _: replicated(mesh), state)
    return dataclasses.replace(
        base,
        params=ps,
        opt_state=mirror_params(state.opt_state, state.params, ps, mesh),
        ref_params=None if state.ref_params is None else ps,
    )


def _declared_batched(tree, path) -> bool:
    """Whether ``path`` passes through a field its dataclass declares ``fields.batched()``."""
    node = tree
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            if is_batched(node, key.name):
                return True
            node = getattr(node, key.name)
        elif isinstance(key, jax.tree_util.DictKey):
            node = node[key.key]
        elif isinstance(key, jax.tree_util.SequenceKey):
            node = node[key.idx]
        else:
            return False
    return False


def batch_shardings(tree, mesh, rules: ShardingRules = ROLLOUT_RULES):
    """Leaves of ``fields.batched()`` fields split their leading axis over the batch axes.

    A bare array (the whole tree is one array, e.g. ``rewards_B``) of rank >= 1 is a batch too;
    every other leaf (``qkv_amax``, metric scalars, undeclared fields) is replicated.
    """
    sizes = mesh_sizes(mesh)
    axes = [a for a in rules.batch_axes if sizes.get(a, 1) > 1]

    def one(path, x):
        batched = _declared_batched(tree, path) if path else x.ndim >= 1
        if not batched or x.ndim == 0:
            return replicated(mesh)
        kept = _fit(x.shape[0], 1, axes, sizes, f"batch {path_str(path) or 'array'}")
        return NamedSharding(mesh, P(_entry(kept), *([None] * (x.ndim - 1))))

    return jax.tree_util.tree_map_with_path(one, tree)


def kv_cache_shardings(cache, mesh, rules: ShardingRules = ROLLOUT_RULES):
    """Shardings of a ``generation.kv.KVCache``: [B, S, K, C] over (batch axes, -, kv-head axes, -);
    dynamic scales [B, K, S] alike."""
    sizes = mesh_sizes(mesh)
    names = {4: ("batch", None, "kv_heads", None), 3: ("batch", "kv_heads", None),
             2: ("batch", None), 1: ("kv_heads",)}  # fmt: skip

    def one(path, x):
        nm = ("batch",) if path_str(path).startswith("lengths") else names[x.ndim]
        return NamedSharding(mesh, P(*map(_entry, spec_for(x.shape, nm, sizes, rules, "cache"))))

    return jax.tree_util.tree_map_with_path(one, cache)


def constrain(tree, shardings):
    """``with_sharding_constraint`` over a pytree (use inside jit, e.g. on the KV cache)."""
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def rollout_params_constraint(cfg: ModelConfig, mesh, rules: ShardingRules = ROLLOUT_RULES):
    """``f(rollout_params) -> rollout_params`` pinned to the rollout layout (use inside jit).

    Apply right after ``quantize_params`` in the rollout program: XLA then all-gathers the FP8
    weights once per step, before the decode loop. Without it the FSDP gathers sit inside the
    ``while_loop`` body and run once per generated token (seen in the compiled HLO).
    """

    def constrain_params(params):
        return constrain(params, param_shardings(params, cfg, mesh, rules))

    return constrain_params


def shard_pytree(tree, shardings):
    """Places a host or single-device pytree onto the mesh (``jax.device_put``)."""
    return jax.device_put(tree, shardings)


def abstract_with_shardings(abstract, shardings):
    """``ShapeDtypeStruct``s carrying shardings: a restore target for orbax."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
