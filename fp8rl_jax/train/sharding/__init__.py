"""Sharding on a device mesh (DESIGN.md §6, docs/SCALING.md).

``mesh``: the named axes and building the mesh; ``specs``: logical-axis rules and the shardings
of weights, train state, batches and KV cache; ``programs``: the shardings the programs are
jitted with (``rl.build_programs(..., program_shardings(...))``).
"""

from fp8rl_jax.train.sharding.mesh import (
    MESH_AXES,
    MeshConfig,
    abstract_mesh,
    make_mesh,
    mesh_sizes,
)
from fp8rl_jax.train.sharding.programs import (
    abstract_prompts,
    program_shardings,
    rows_sharding,
    step_shardings,
)
from fp8rl_jax.train.sharding.specs import (
    ROLLOUT_RULES,
    TRAIN_RULES,
    ShardingRules,
    abstract_with_shardings,
    batch_shardings,
    constrain,
    kv_cache_shardings,
    mirror_params,
    param_shardings,
    param_specs,
    replicated,
    rollout_params_constraint,
    shard_pytree,
    spec_for,
    train_state_shardings,
)

__all__ = [
    "MESH_AXES",
    "ROLLOUT_RULES",
    "TRAIN_RULES",
    "MeshConfig",
    "ShardingRules",
    "abstract_mesh",
    "abstract_prompts",
    "abstract_with_shardings",
    "batch_shardings",
    "constrain",
    "kv_cache_shardings",
    "make_mesh",
    "mesh_sizes",
    "mirror_params",
    "param_shardings",
    "param_specs",
    "program_shardings",
    "replicated",
    "rollout_params_constraint",
    "rows_sharding",
    "shard_pytree",
    "spec_for",
    "step_shardings",
    "train_state_shardings",
]
