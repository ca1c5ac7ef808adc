"""The models a benchmark compares: residual designs, alone or with the local mixer, each
optionally with model options of its own.

``--designs`` names them as ``variant_label`` prints them (``<design>`` or
``<design>+shortswa``), optionally followed by ``:model.key=value`` overrides that apply to
that variant only, e.g. ``ddl:model.ddl.dv=4`` next to ``ddl`` (several: ``:a=1:b=2``). The
default is every registered design without the mixer.
"""

from __future__ import annotations

from typing import Optional

from t2train.config.loader import load_config
from t2train.config.schema import Config, ConfigError
from t2train.residual import mixer, registered, variant_label, variant_overrides


def variant_names(designs: Optional[str]) -> list[str]:
    names = designs.split(",") if designs else list(registered())
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"--designs: {', '.join(map(repr, repeated))} given more than once")
    return names


def all_variants() -> list[str]:
    """Every registered design, alone and with the local mixer."""
    return [v for d in registered() for v in (d, f"{d}+{mixer().name}")]


def split_variant(variant: str) -> tuple[str, list[str]]:
    """``ddl+shortswa:model.a=1:model.b=2`` ->
    (``ddl+shortswa``, [``model.a=1``, ``model.b=2``])."""
    label, *overrides = variant.split(":")
    for item in overrides:
        if not item.startswith("model.") or "=" not in item:
            raise ConfigError(
                f"--designs {variant!r}: {item!r} is not a model.key=value "
                "override (a variant may set model options only, so that every "
                "variant trains the same way)"
            )
    return label, overrides


def variant_config(
    preset: Optional[str],
    config_file: Optional[str],
    overrides: list[str],
    variant: str,
    *extra: str,
) -> Config:
    """The config of one variant: the base config, the variant's choice and its own model
    overrides, then ``extra``."""
    label, own = split_variant(variant)
    base = load_config(preset, config_file, overrides)
    try:
        chosen = variant_overrides(label, base.model)
    except KeyError as err:
        raise ConfigError(f"--designs: {err.args[0]}") from None
    config = load_config(preset, config_file, [*overrides, *chosen, *own, *extra])
    if variant_label(config.model) != label:
        raise ConfigError(
            f"--designs {variant!r}: its overrides make it "
            f"{variant_label(config.model)!r}; spell it as that"
        )
    return config
