"""Build a validated ``Config`` from a preset, an optional YAML file and dotted overrides.

Order of precedence (later wins): dataclass defaults < preset < YAML file < ``a.b=value``.
Override values are parsed as YAML scalars (``4`` -> int, ``true`` -> bool, ``null`` -> None),
then checked against the field's declared type.
"""

from __future__ import annotations

import dataclasses
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, Union

import yaml

from t2train.config.schema import Config, ConfigError

PRESET_PACKAGE = "t2train.config.presets"


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(PRESET_PACKAGE).iterdir()
                  if p.name.endswith(".yaml"))


def _read_yaml(text: str, source: str) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML ({err.__class__.__name__}: "
                          f"{str(err).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of config sections, got "
                          f"{type(data).__name__}")
    return data


def load_preset(name: str) -> dict:
    if name not in preset_names():
        raise ConfigError(f"preset={name!r}: unknown preset, choose one of {preset_names()}")
    text = resources.files(PRESET_PACKAGE).joinpath(f"{name}.yaml").read_text()
    return _read_yaml(text, f"preset {name}")


def load_yaml_file(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path!r}: does not exist")
    return _read_yaml(file.read_text(), f"config file {path}")


def parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. model.num_layers=4")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _nest(path: list[str], value: Any) -> dict:
    nested: Any = value
    for key in reversed(path):
        nested = {key: nested}
    return nested


def _coerce(value: Any, kind: Any, name: str) -> Any:
    """Check ``value`` against a field type; ints are accepted where floats are expected."""
    origin = typing.get_origin(kind)
    if origin is Union:
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, name)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{name}={value!r}: invalid")
    if origin is Literal:
        allowed = typing.get_args(kind)
        if value not in allowed:
            raise ConfigError(f"{name}={value!r}: must be one of {list(allowed)}")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}: must be true or false")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}={value!r}: must be an integer")
        return value
    if kind is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}={value!r}: must be a number")
        return float(value)
    if kind is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}: must be a string")
        return str(value)
    raise ConfigError(f"{name}: unsupported field type {kind!r}")


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}={data!r}: must be a mapping")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown field; known fields of "
                          f"{prefix.rstrip('.') or 'the config'}: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            kwargs[name] = _build(kind, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, kind, f"{prefix}{name}")
    return cls(**kwargs)


def load_config(preset: Optional[str] = None, config_file: Optional[str] = None,
                overrides: Iterable[str] = ()) -> Config:
    """Return a validated config or raise ``ConfigError`` naming the offending field."""
    data: dict = {}
    if preset is not None:
        data = _merge(data, load_preset(preset))
    if config_file is not None:
        data = _merge(data, load_yaml_file(config_file))
    for item in overrides:
        path, value = parse_override(item)
        data = _merge(data, _nest(path, value))
    return _build(Config, data, "").validate()


def config_to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)
