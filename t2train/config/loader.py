"""Build a validated ``Config`` from a preset, an optional YAML file and dotted overrides.

Order of precedence (later wins): dataclass defaults < preset < YAML file < ``a.b=value``.
Override values are parsed as YAML scalars (``4`` -> int, ``true`` -> bool, ``null`` -> None),
then checked against the field's declared type.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, Union

import yaml

from t2train.config.arguments import PRESET_PACKAGE, preset_names
from t2train.config.schema import CONFIG_FORMAT, Config, ConfigError, TrainConfig
from t2train.residual import resolve_aliases


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters for one-line error messages."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int past Python's digit limit; deep nesting
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _yaml_problem(err: BaseException) -> str:
    """One line saying why PyYAML (or Python under it) could not read a document."""
    if isinstance(err, RecursionError):
        return "too deeply nested"
    if isinstance(err, yaml.MarkedYAMLError) and err.problem:
        where = (
            f" at line {err.problem_mark.line + 1}, column {err.problem_mark.column + 1}"
            if err.problem_mark is not None
            else ""
        )
        cause = f"{err.problem}{where}"
        if "python/" in str(err.problem):
            cause += "; configs are data: tags that build Python objects are refused"
    else:
        lines = str(err).strip().splitlines()
        cause = lines[0] if lines else ""
    return f"{type(err).__name__}: {cause}"


# Data only: the safe loader's constructor builds no Python object from a tag (``!!python/...``
# is refused). libyaml's parser, when PyYAML has it, is the same YAML 1.1 with a nesting limit
# (1000) and no Python recursion, so a hostile file fails in milliseconds.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _safe_load(text: str) -> Any:
    return yaml.load(text, Loader=_SAFE_LOADER)  # a safe loader


# What safe_load can raise besides YAMLError: impossible dates and integers past Python's
# digit limit (ValueError), nesting deeper than the parser's recursion (RecursionError).
_YAML_FAULTS = (yaml.YAMLError, ValueError, OverflowError, RecursionError)


def _read_yaml(text: str, source: str) -> dict:
    """Parse YAML as data only (``safe_load``: no tag builds a Python object)."""
    try:
        data = _safe_load(text)
    except _YAML_FAULTS as err:
        raise ConfigError(f"{source}: not valid YAML ({_yaml_problem(err)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: expected a mapping of config sections, got {type(data).__name__}"
        )
    return data


def load_preset(name: str) -> dict:
    if name not in preset_names():
        raise ConfigError(f"preset={name!r}: unknown preset, choose one of {preset_names()}")
    return _read_yaml(_preset_text(name), f"preset {name}")


@functools.lru_cache(maxsize=None)
def _preset_text(name: str) -> str:
    return resources.files(PRESET_PACKAGE).joinpath(f"{name}.yaml").read_text()


def load_yaml_file(path: str) -> dict:
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"config file {path!r}: is a directory, not a file")
    if not file.is_file():
        raise ConfigError(f"config file {path!r}: does not exist")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file {path}: not UTF-8 text (byte {err.object[err.start]:#04x} "
            f"at offset {err.start})"
        ) from None
    except OSError as err:
        raise ConfigError(f"config file {path}: cannot read it ({err.strerror or err})") from None
    return _read_yaml(text, f"config file {path}")


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value); the value is read as a YAML scalar or flow
    collection, and text YAML cannot parse is taken as a plain string."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            f"override {short(item)}: expected dotted.key=value, e.g. model.num_layers=4"
        )
    try:
        value = _safe_load(raw) if raw else ""
    except (
        yaml.constructor.ConstructorError,
        ValueError,
        OverflowError,
        RecursionError,
    ) as err:  # a tag, a bad date, too many digits, too deep
        raise ConfigError(
            f"override {short(item)}: not a valid YAML value ({_yaml_problem(err)})"
        ) from None
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
        raise ConfigError(errors[0] if errors else f"{name}={short(value)}: invalid")
    if origin is Literal:
        allowed = typing.get_args(kind)
        if isinstance(value, bool) or not any(
            type(value) is type(option) and value == option for option in allowed
        ):
            raise ConfigError(f"{name}={short(value)}: must be one of {list(allowed)}")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={short(value)}: must be true or false")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}={short(value)}: must be an integer")
        if not -(2**63) <= value < 2**63:
            raise ConfigError(f"{name}={short(value)}: must be an integer in [-2**63, 2**63)")
        return value
    if kind is float:
        number = value
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"{name}={short(value)}: must be a number") from None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}={short(value)}: must be a number")
        try:
            number = float(number)
        except OverflowError:  # an int beyond the float range
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{name}={short(value)}: must be a finite number")
        return number
    if kind is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{name}={short(value)}: must be a string")
        return str(value)
    raise ConfigError(f"{name}: unsupported field type {kind!r}")


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict:
    return typing.get_type_hints(cls)  # evaluates the schema's string annotations: slow


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}={short(data)}: must be a mapping")
    hints = _type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known, key=str)  # YAML keys may be ints, None, ...
    if unknown:
        shown = str(unknown[0])[:60]
        shown = shown if shown.isprintable() else repr(shown)  # the error stays one line
        close = difflib.get_close_matches(str(unknown[0]), known, n=1)
        hint = f"did you mean {prefix}{close[0]}? " if close else ""
        raise ConfigError(
            f"{prefix}{shown}: unknown field; {hint}known fields of "
            f"{prefix.rstrip('.') or 'the config'}: {sorted(known)}"
        )
    kwargs = {}
    for name, value in data.items():
        kind = hints[name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            kwargs[name] = _build(kind, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, kind, f"{prefix}{name}")
    return cls(**kwargs)


def load_config(
    preset: Optional[str] = None, config_file: Optional[str] = None, overrides: Iterable[str] = ()
) -> Config:
    """Return a validated config or raise ``ConfigError`` naming the offending field."""
    data: dict = {}
    given: dict = {}  # what the config file and the overrides set, not the preset
    if preset is not None:
        data = _merge(data, load_preset(preset))
    if config_file is not None:
        given = _merge(given, load_yaml_file(config_file))
    for item in overrides:
        path, value = parse_override(item)
        given = _merge(given, _nest(path, value))
    data = _warmup_within_the_run(_merge(data, given), given)
    if isinstance(data.get("model"), dict):
        data["model"] = resolve_aliases(data["model"], CONFIG_FORMAT)
    return _build(Config, data, "").validate()


def _warmup_within_the_run(data: dict, given: dict) -> dict:
    """A warm-up nobody asked for (the preset's or the default) that is as long as the run
    becomes a tenth of it, so ``train.steps=10`` is a smoke run; one given is checked."""
    train = data.get("train")
    if not isinstance(train, dict) or "warmup_steps" in (given.get("train") or {}):
        return data
    steps = train.get("steps", TrainConfig.steps)
    warmup = train.get("warmup_steps", TrainConfig.warmup_steps)
    if isinstance(steps, int) and isinstance(warmup, int) and 1 <= steps <= warmup:
        data = dict(data, train=dict(train, warmup_steps=steps // 10))
    return data


def config_from_dict(data: dict, config_format: int = CONFIG_FORMAT) -> Config:
    """A config recorded as a mapping (a checkpoint's ``asdict(Config)``) in ``config_format``,
    old spellings resolved; ``ConfigError`` names a field it does not accept."""
    data = dict(data)
    if isinstance(data.get("model"), dict):
        data["model"] = resolve_aliases(data["model"], config_format)
    return _build(Config, data, "").validate()


def config_to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{"a.b": value}``; an empty mapping is a value."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)
