"""Field declarations of the frozen dataclasses: per-row batch arrays, and allowed values.

A field made with ``batched()`` holds arrays whose leading axis is the batch (rows): a mesh
splits that axis over its batch axes (``train.sharding.batch_shardings``); every other field is
replicated. The declaration is on the field, not inferred from its name, so a new field is
sharded only when it says so.

A config field typed ``Literal[...]`` lists its allowed values there; ``check_choices`` enforces
them in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal

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


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def choices(hint: Any) -> tuple | None:
    """The values a ``Literal[...]`` type (or ``Literal[...] | None``) allows; None otherwise."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        literal = [a for a in args if typing.get_origin(a) is Literal]
        if len(literal) == 1 and set(args) <= {literal[0], type(None)}:
            return typing.get_args(literal[0]) + ((None,) if type(None) in args else ())
    return None


def check_choices(obj: Any) -> None:
    """Raises ``ValueError`` naming the field when a ``Literal``-typed field holds another value.

    Call it from ``__post_init__``: the ``Literal`` annotation is then the one list of allowed
    values, for configs built in code and (through ``train.config``) from config files.
    """
    cls = type(obj)
    for name, hint in _hints(cls).items():
        allowed = choices(hint)
        if allowed is not None and getattr(obj, name) not in allowed:
            raise ValueError(
                f"{cls.__name__}.{name} must be one of {allowed}, got {getattr(obj, name)!r}"
            )
