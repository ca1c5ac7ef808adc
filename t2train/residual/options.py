"""``model.<section>``: the typed options of every design that has them and of the local
mixer, one field per section (light: the declarations only, no torch).

``ModelConfig`` (``t2train/config/schema.py``) inherits these fields, so ``model.hc.
expansion_rate`` is a declared attribute an IDE and a type checker follow. Each field's type
is the ``options`` its declaration names (``tests/test_config.py`` checks the two agree): a
new design with options adds its section here, beside its line in the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from t2train.residual.attnres import AttnResOptions
from t2train.residual.ddl import DDLOptions
from t2train.residual.depth_attn import DepthAttnOptions
from t2train.residual.hc import HCOptions
from t2train.residual.mhc import MHCOptions
from t2train.residual.shortswa import ShortSWAOptions


@dataclass
class DesignOptions:
    ddl: DDLOptions = field(default_factory=DDLOptions)
    depth_attn: DepthAttnOptions = field(default_factory=DepthAttnOptions)
    attnres: AttnResOptions = field(default_factory=AttnResOptions)  # attnres, block_attnres
    hc: HCOptions = field(default_factory=HCOptions)
    mhc: MHCOptions = field(default_factory=MHCOptions)
    shortswa: ShortSWAOptions = field(default_factory=ShortSWAOptions)  # the local mixer

    def validate_sections(self) -> None:
        for section in fields(DesignOptions):
            getattr(self, section.name).validate(f"model.{section.name}")
