"""Frozen-dataclass configs with YAML/dict overrides.

Every config in tmax-jax is a frozen dataclass. Files under ``configs/`` only *override* fields of a
preset; an unknown key is an error that names the key and its path, so a typo never silently falls
back to a default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tmax_jax.errors import ConfigError

T = TypeVar("T")


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert a YAML value to the annotated type, or raise ConfigError naming ``path``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{path}: {value!r} matches none of {tp}: {'; '.join(errors)}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{path}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return override(tp(), value, _path=path)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            items = [_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            item_tp = args[0] if args else Any
            items = [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML reads "1e-6" as a string; accept it when it parses as a number.
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def override(cfg: T, updates: Mapping[str, Any], *, _path: str = "") -> T:
    """Return a copy of dataclass ``cfg`` with ``updates`` applied (nested mappings recurse).

    Raises ConfigError naming the first unknown key or badly typed value.
    """
    if not dataclasses.is_dataclass(cfg):
        raise TypeError(f"override() needs a dataclass instance, got {type(cfg).__name__}")
    types_ = _field_types(type(cfg))
    changes: dict[str, Any] = {}
    for key, value in updates.items():
        path = f"{_path}.{key}" if _path else str(key)
        if key not in types_:
            known = ", ".join(sorted(types_))
            raise ConfigError(f"unknown config key '{path}' for {type(cfg).__name__} (known: {known})")
        tp = types_[key]
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            changes[key] = override(current, value, _path=path)
        else:
            changes[key] = _coerce(value, tp, path)
    return dataclasses.replace(cfg, **changes)


def parse_dotted(pairs: list[str]) -> dict[str, Any]:
    """Turn CLI overrides like ``rl.delta=0.2`` into a nested dict (values parsed as YAML scalars)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r} must look like key.sub=value")
        key, raw = pair.split("=", 1)
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw)
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return dict(data)


def to_dict(cfg: Any) -> Any:
    """Plain-data view of a (nested) dataclass config, for YAML dumps of the resolved config."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg
