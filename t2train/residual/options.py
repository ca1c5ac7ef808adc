"""``model.<section>``: the typed options of every design that has them and of the local
mixer, one field per section, taken from the registry (light: the declarations only, no
torch).

``ModelConfig`` (``t2train/config/schema.py``) inherits these fields, so ``model.hc`` is a
dataclass field of the options class the design declares (``ResidualDesign.options``): a
design's section comes with its one registry line, in the registry's order, the mixer's
last. The fields are added to the class below before it becomes a dataclass, so the class
itself is declared here, not built (``tests/test_config.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from t2train.residual import get_design, mixer, registered


def declared_sections() -> dict[str, type]:
    """Section name -> its options class: each design's with options (designs that share a
    section, as the AttnRes pair, declare the same class), then the mixer's."""
    sections: dict[str, type] = {}
    for name in registered():
        design = get_design(name)
        if design.section is not None and design.options is not None:
            if sections.setdefault(design.section, design.options) is not design.options:
                raise TypeError(
                    f"model.{design.section}: designs sharing a section must declare the same "
                    f"options class ({name} declares {design.options.__name__})"
                )
    sections[mixer().section] = mixer().options
    return sections


class DesignOptions:
    """The design option sections of ``ModelConfig``."""

    def validate_sections(self) -> None:
        for section in fields(DesignOptions):  # type: ignore[arg-type] # a dataclass below
            getattr(self, section.name).validate(f"model.{section.name}")


for _section, _options in declared_sections().items():
    DesignOptions.__annotations__[_section] = _options
    setattr(DesignOptions, _section, field(default_factory=_options))
dataclass(DesignOptions)  # the same class, with the fields above
