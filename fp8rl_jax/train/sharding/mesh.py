"""The device mesh (DESIGN.md §6): named axes, their sizes, and how the mesh is built.

Mesh axes, outermost first (the innermost axis gets neighbouring devices, i.e. NVLink peers):
  ``data``   pure data parallelism: weights replicated (cross-node friendly: one all-reduce)
  ``fsdp``   training: weights and optimizer state sharded (ZeRO-3); rollout: more data parallelism
  ``expert`` MoE experts sharded; dense layers treat it as data parallelism (batch is split on it)
  ``tensor`` Megatron tensor parallelism over query/KV heads, MLP hidden dim and vocab

Axis types are ``AxisType.Auto`` (GSPMD/Shardy propagation): the model code has no sharding
annotations and jax 0.11+ ``jax.make_mesh`` defaults to Explicit axes, which would reject it.
Install the mesh with ``jax.set_mesh(mesh)`` (never ``with mesh:``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh

MESH_AXES = ("data", "fsdp", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; any may be 1, one may be -1 ("all remaining devices")."""

    data: int = 1  # data-parallel replicas (weights replicated)
    fsdp: int = -1  # FSDP shards in training; extra data parallelism in rollout
    expert: int = 1  # expert-parallel shards (MoE); data parallelism for dense layers
    tensor: int = 1  # tensor-parallel shards (heads, MLP hidden, vocab)

    def __post_init__(self):
        sizes = dataclasses.astuple(self)
        if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
            raise ValueError(f"{self}: sizes must be >= 1, with at most one -1")

    def axis_sizes(self, num_devices: int) -> tuple[int, ...]:
        """Sizes in ``MESH_AXES`` order with -1 resolved; raises if they don't use all devices."""
        sizes = list(dataclasses.astuple(self))
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(
                    f"{self}: {num_devices} devices are not divisible by the fixed axes' "
                    f"product {known}, so -1 cannot be resolved"
                )
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"{self} needs {math.prod(sizes)} devices but {num_devices} are available; "
                "the product of the axis sizes must equal the device count (use -1 for one axis)"
            )
        return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """A ``Mesh`` over ``devices`` (default all, across processes) with Auto axis types."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = cfg.axis_sizes(len(devices))
    auto = (AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(sizes, MESH_AXES, axis_types=auto, devices=devices)


def abstract_mesh(cfg: MeshConfig, num_devices: int) -> AbstractMesh:
    """A device-free mesh of the same shape, for planning shardings (and tests)."""
    sizes = cfg.axis_sizes(num_devices)
    return AbstractMesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_sizes(mesh) -> Mapping[str, int]:
    """Axis name -> size of a ``Mesh``, an ``AbstractMesh`` or a plain mapping."""
    return mesh.shape if hasattr(mesh, "shape") else dict(mesh)
