"""The models a benchmark compares: residual designs, alone or with the local mixer.

``--designs ddl,ddl+shortswa`` names them as ``variant_label`` prints them; the default is
every registered design without the mixer.
"""

from __future__ import annotations

from typing import Optional

from t2train.config.loader import load_config
from t2train.config.schema import Config, ConfigError
from t2train.residual import registered, variant_overrides


def variant_names(designs: Optional[str]) -> list[str]:
    return designs.split(",") if designs else list(registered())


def variant_config(preset: Optional[str], config_file: Optional[str], overrides: list[str],
                   variant: str, *extra: str) -> Config:
    """The config of one variant: the base config, the variant's choice, then ``extra``."""
    base = load_config(preset, config_file, overrides)
    try:
        chosen = variant_overrides(variant, base.model)
    except KeyError as err:
        raise ConfigError(f"--designs: {err.args[0]}") from None
    return load_config(preset, config_file, [*overrides, *chosen, *extra])
