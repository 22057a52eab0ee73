"""The ``ConfigDict`` of the dataclass defaults: every field of an ``Experiment``, nothing else.

The frozen dataclasses (``fp8rl_jax.train.experiment.Experiment`` and the configs it holds) are
the one source of defaults and of each field's meaning (its trailing comment there). This turns
them into the ``ConfigDict`` that config files start from and the command line overrides:
- a field that may be None becomes a typed ``FieldReference``, so ``--config.a.b=...`` parses
  the value with the field's type and None stays allowed;
- ``rollout.quant`` (a recipe or None) becomes the recipe's fields plus ``enabled``, the form
  ``experiment_from_config`` turns back into a ``QuantRecipe`` or None.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from ml_collections import config_dict

from fp8rl_jax.train.experiment import Experiment


def _optional(hint: Any) -> Any | None:
    """``X`` of an ``X | None`` annotation (Literal[...] -> its value type), else None."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) != 1 or len(args) == len(typing.get_args(hint)):
        return None
    (inner,) = args
    if typing.get_origin(inner) is Literal:
        return type(typing.get_args(inner)[0])
    return typing.get_origin(inner) or inner


def _section(obj: Any) -> config_dict.ConfigDict:
    hints = typing.get_type_hints(type(obj))
    section = config_dict.ConfigDict()
    for f in dataclasses.fields(obj):
        value, inner = getattr(obj, f.name), _optional(hints[f.name])
        if inner is not None and dataclasses.is_dataclass(inner):  # a recipe or None
            section[f.name] = _section(value if value is not None else inner())
            section[f.name].enabled = value is not None
        elif dataclasses.is_dataclass(value):
            section[f.name] = _section(value)
        elif inner is not None:
            section[f.name] = config_dict.FieldReference(value, field_type=inner)
        else:
            section[f.name] = value
    return section


def experiment_config(exp: Experiment | None = None) -> config_dict.ConfigDict:
    """Every field of ``exp`` (default: ``Experiment()``, the dataclass defaults)."""
    return _section(Experiment() if exp is None else exp)


def set_path(config: config_dict.ConfigDict, path: str, value: Any) -> None:
    """``config.a.b.c = value`` for ``path="a.b.c"``."""
    *parents, name = path.split(".")
    node = config
    for p in parents:
        node = node[p]
    node[name] = value
