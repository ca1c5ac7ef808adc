"""Residual-stream designs, selected by ``model.residual``.

Each design provides a ``ResidualDesign`` (see ``base.py``): the model-level stream (how the
embedding enters the stream, what crosses a pipeline hop, what the final norm reads) and the
per-sublayer residual operator (how a sublayer reads its input from the stream and writes its
output back). The registry maps names to modules lazily so that reading a config does not
import torch.
"""

from __future__ import annotations

import importlib

_DESIGNS = {  # name -> (module, attribute)
    "standard": ("t2train.residual.standard", "DESIGN"),
    "ddl": ("t2train.residual.ddl", "DESIGN"),
    "shortswa": ("t2train.residual.shortswa", "DESIGN"),
    "depth_attn": ("t2train.residual.depth_attn", "DESIGN"),
    "attnres": ("t2train.residual.attnres", "FULL"),
    "block_attnres": ("t2train.residual.attnres", "BLOCK"),
}


def registered() -> tuple[str, ...]:
    return tuple(_DESIGNS)


def get_design(name: str):
    """The ``ResidualDesign`` registered under ``name``."""
    if name not in _DESIGNS:
        raise KeyError(f"model.residual={name!r}: unknown residual design, choose one of "
                       f"{sorted(_DESIGNS)}")
    module, attribute = _DESIGNS[name]
    return getattr(importlib.import_module(module), attribute)
