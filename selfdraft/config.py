"""Typed configs: frozen dataclasses are the schema, YAML is the data, ``key=value`` overrides win.

Each field carries ``metadata={"help": ...}`` (shown by ``--help``). Unknown keys are errors.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A config file or override names an unknown key or holds a value of the wrong type."""


def opt(default: Any, help: str) -> Any:
    """A dataclass field with a default and a one-line help text."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: default, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def _coerce(cls: type, name: str, value: Any) -> Any:
    hint = get_type_hints(cls)[name]
    origin = getattr(hint, "__origin__", None)
    if value is None:
        return None
    if hint is bool or hint == "bool":
        if isinstance(value, str):
            if value.lower() in ("true", "1", "yes"):
                return True
            if value.lower() in ("false", "0", "no"):
                return False
            raise ConfigError(f"{name}: expected true/false, got '{value}'")
        return bool(value)
    if hint in (int, float, str):
        try:
            return hint(value)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{name}: expected {hint.__name__}, got {value!r}") from err
    if origin in (list, tuple) or hint in (list, tuple):
        if isinstance(value, str):
            items = value.split()
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:  # a single scalar (YAML reads ``batch_sizes=1`` as an int)
            items = [value]
        items = [str(i).strip() for i in items if str(i).strip()]
        return tuple(items) if tuple in (origin, hint) else items
    return value


def from_dict(cls: type[C], data: dict[str, Any]) -> C:
    """Build ``cls`` from a flat dict; unknown keys raise :class:`ConfigError` listing the known ones."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown}; known: {sorted(names)}")
    return cls(**{k: _coerce(cls, k, v) for k, v in data.items()})


def load(cls: type[C], path: str | Path | None = None, overrides: list[str] = ()) -> C:
    """Defaults <- YAML file <- ``key=value`` overrides (dots are accepted for nesting-free keys)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: a config file must be a mapping of key: value")
        data.update(loaded)
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"override '{item}' is not key=value")
        data[key.strip().replace("-", "_")] = yaml.safe_load(value)
    return from_dict(cls, data)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--flag`` per field, with the field's help text and default."""
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=argparse.SUPPRESS,
            help=f"{f.metadata.get('help', '')} (default: {default})",
        )


def from_args(cls: type[C], args: argparse.Namespace, config_path: str | None = None) -> C:
    """Defaults <- optional YAML <- command-line flags that were given."""
    base = dataclasses.asdict(load(cls, config_path))
    names = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in vars(args).items() if k in names}
    return from_dict(cls, {**base, **given})
