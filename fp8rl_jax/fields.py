"""Field declarations of the frozen dataclasses: which fields hold per-row batch arrays.

A field made with ``batched()`` holds arrays whose leading axis is the batch (rows): a mesh
splits that axis over its batch axes (``train.sharding.batch_shardings``); every other field is
replicated. The declaration is on the field, not inferred from its name, so a new field is
sharded only when it says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

BATCH = "batch"  # metadata key: True on fields whose arrays are [B, ...]


def batched(**kwargs: Any) -> Any:
    """A dataclass field of [B, ...] arrays (``dataclasses.field`` arguments pass through)."""
    metadata = {**kwargs.pop("metadata", {}), BATCH: True}
    return dataclasses.field(metadata=metadata, **kwargs)


def is_batched(obj: Any, name: str) -> bool:
    """Whether field ``name`` of dataclass (instance or type) ``obj`` is declared [B, ...]."""
    if not dataclasses.is_dataclass(obj):
        return False
    field = next((f for f in dataclasses.fields(obj) if f.name == name), None)
    return field is not None and bool(field.metadata.get(BATCH, False))
