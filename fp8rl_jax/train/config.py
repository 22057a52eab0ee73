"""ConfigDict -> nested frozen dataclasses, with errors that name the full field path.

The entry point calls ``train.experiment.experiment_from_config(config)``, which calls
``from_config_dict(Experiment, ...)``; library code only sees the dataclasses.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union


class ConfigError(ValueError):
    """A config value that does not fit its dataclass field; the message starts with its path."""


def _as_mapping(cd: Any, path: str) -> Mapping[str, Any]:
    if isinstance(cd, Mapping):
        return cd
    if hasattr(cd, "to_dict"):  # ml_collections.ConfigDict / FrozenConfigDict
        return cd.to_dict()
    raise ConfigError(f"{path}: expected a mapping of fields, got {type(cd).__name__}")


def from_config_dict[T](cls: type[T], cd: Any, path: str = "config") -> T:
    """Builds dataclass `cls` from a ConfigDict or mapping, recursively and strictly.

    Unknown keys, missing required fields, wrong types, values outside a `Literal[...]` and
    errors raised by `__post_init__` all raise ConfigError naming e.g. `config.rollout.kv_dtype`.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    values = _as_mapping(cd, path)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in values:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; known fields: {sorted(fields)}"
            raise ConfigError(f"{path}.{key}: unknown field{hint}")
    kwargs = {}
    for name, field in fields.items():
        if name in values:
            kwargs[name] = _convert(values[name], hints[name], f"{path}.{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{path}.{name}: missing required field")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: {e}") from e


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return from_config_dict(tp, value, path)
    if origin is Literal:
        if value not in args or type(value) not in {type(a) for a in args}:
            raise ConfigError(f"{path}: {value!r} is not allowed; allowed values: {list(args)}")
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(value, args, path)
    if origin in (tuple, list):
        if not isinstance(value, tuple | list):
            raise ConfigError(f"{path}: expected a sequence, got {type(value).__name__}")
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            args = (args[0],) * len(value)
        elif origin is list:
            args = (args[0] if args else Any,) * len(value)
        elif args and len(args) != len(value):
            raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
        items = [_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        key_tp, value_tp = args or (Any, Any)
        mapping = _as_mapping(value, path)
        return {
            _convert(k, key_tp, path): _convert(v, value_tp, f"{path}.{k}")
            for k, v in mapping.items()
        }
    return _convert_scalar(value, tp, path)


def _convert_union(value: Any, args: tuple[Any, ...], path: str) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{path}: None is not allowed")
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(value, arg, path)
        except ConfigError as e:
            errors.append(str(e).removeprefix(f"{path}: "))
    raise ConfigError(f"{path}: {value!r} matches no type of the union ({'; '.join(errors)})")


def _convert_scalar(value: Any, tp: Any, path: str) -> Any:
    if tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return float(value) if ok else _type_error(value, tp, path)
    if tp is int:
        return (
            value
            if isinstance(value, int) and not isinstance(value, bool)
            else _type_error(value, tp, path)
        )
    if isinstance(tp, type):
        return value if isinstance(value, tp) else _type_error(value, tp, path)
    return value  # an annotation we do not check (e.g. a Callable)


def _type_error(value: Any, tp: Any, path: str) -> typing.NoReturn:
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} ({value!r})")


def _field_types(cls: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _as_dataclass(tp: Any) -> Any:
    """``tp`` or the dataclass of an ``X | None`` annotation; None when it is no dataclass."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return inner[0] if len(inner) == 1 else None
    return None


def check_field_path(cls: type, path: str, extra: tuple[str, ...] = ()) -> None:
    """Raises ConfigError when dotted ``path`` ("rollout.kv_cache_dtype") names no field of
    dataclass ``cls`` (``extra``: further accepted paths), with the closest name as a hint."""
    tp, parts = cls, path.split(".")
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        if here in extra:
            return
        fields = _field_types(tp) if tp is not None else {}
        if part not in fields:
            parent = f"config.{'.'.join(parts[:i])}" if i else "config"
            if not fields:
                raise ConfigError(f"config.{here}: {parent} is a value, not a section of fields")
            close = difflib.get_close_matches(part, list(fields), n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; known fields: {sorted(fields)}"
            raise ConfigError(f"config.{here}: unknown field{hint}")
        tp = _as_dataclass(fields[part])


def to_dict(config: Any) -> dict[str, Any]:
    """A dataclass config as nested plain dicts (tuples stay lists-compatible for JSON)."""
    return dataclasses.asdict(config)
