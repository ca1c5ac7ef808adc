"""The command-line arguments that select a config: a preset, a YAML file, dotted overrides.

Kept apart from the loader so that building the CLI's parser imports neither the schema nor
the residual designs it composes (which import torch and Megatron).
"""

from __future__ import annotations

import argparse
from importlib import resources

PRESET_PACKAGE = "t2train.config.presets"
# The sections of ``Config``, for help texts (tests/test_cli.py keeps them in step).
CONFIG_SECTIONS = ("model", "parallel", "train", "data", "checkpoint", "deepspeed", "log")


def preset_names() -> list[str]:
    return sorted(
        p.name[:-5] for p in resources.files(PRESET_PACKAGE).iterdir() if p.name.endswith(".yaml")
    )


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", help=f"start from a preset: {', '.join(preset_names())}")
    parser.add_argument("--config", help="a YAML file of config sections, applied after the preset")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.field=value", help="dotted overrides, applied last"
    )
