"""Residual-stream designs (``model.residual``) and the local mixer (``model.shortswa``).

Two independent choices make a model's residual stream:

* the residual operator, ``model.residual``: how each sublayer reads its input from the stream
  and writes its output back, and what the stream carries (a ``ResidualDesign``, ``base.py``);
* the local mixer: a sequence-axis ShortSWA sublayer before attention, on when
  ``model.shortswa.window > 0``, written through the chosen operator like any sublayer.

A combination is labelled ``<design>`` or ``<design>+shortswa`` (``variant_label``); the
same spelling selects it in ``t2train bench step`` and ``t2train experiment compare``.

Adding a design: one module here with a ``ResidualDesign``, one line in ``_DESIGNS``, its
export part ``<module>_hf.py`` beside it, and its tests (docs/residuals.md, "How to add a
design"); a fused kernel adds its ``Kernel`` declaration to the design's module and one entry
in ``kernel_table()``. Modules are imported on first use.
"""

from __future__ import annotations

import importlib

_DESIGNS = {  # name -> (module, attribute)
    "standard": ("t2train.residual.standard", "DESIGN"),
    "ddl": ("t2train.residual.ddl", "DESIGN"),
    "depth_attn": ("t2train.residual.depth_attn", "DESIGN"),
    "attnres": ("t2train.residual.attnres", "FULL"),
    "block_attnres": ("t2train.residual.attnres", "BLOCK"),
    "hc": ("t2train.residual.hc", "DESIGN"),
    "mhc": ("t2train.residual.mhc", "DESIGN"),
}
BASELINE = "standard"  # the default design, and the one benchmarks compare against
_MIXER = ("t2train.residual.shortswa", "MIXER")
# Old spellings: name -> (design, window the mixer gets when the config leaves it at 0).
_ALIASES = {"shortswa": ("standard", 128)}  # shortswa was a design of its own (config format 1)


def registered() -> tuple[str, ...]:
    return tuple(_DESIGNS)


def design_module(name: str) -> str:
    """The module that implements design ``name`` (its export part is ``<module>_hf.py``)."""
    return _DESIGNS[name][0]


def get_design(name: str):
    """The ``ResidualDesign`` registered under ``name``."""
    if name not in _DESIGNS:
        raise KeyError(
            f"model.residual={name!r}: unknown residual design, choose one of {sorted(_DESIGNS)}"
        )
    module, attribute = _DESIGNS[name]
    return getattr(importlib.import_module(module), attribute)


def mixer():
    """The ``LocalMixer`` (ShortSWA)."""
    module, attribute = _MIXER
    return getattr(importlib.import_module(module), attribute)


def kernel_table() -> dict:
    """The kernel table: every fused Triton kernel by name, a ``t2train.kernels.dispatch.
    Kernel`` (name, Triton function, PyTorch reference) declared once beside its reference.
    The dispatch routes each declaration; the tests and ``t2train.bench.kernels`` read this."""
    from t2train.nn import precision  # noqa: PLC0415 - the designs import this registry
    from t2train.residual import attnres, ddl, hc, mhc, window_attention  # noqa: PLC0415 - the designs import this registry

    table = [
        window_attention.WINDOW_ATTENTION,
        ddl.DELTA_WRITE,
        precision.FP32_LINEAR,
        precision.RMS_FP32_LINEAR,
        attnres.DEPTH_MIX,
        attnres.BLOCK_PHASE_1,
        attnres.BLOCK_PHASE_2,
        mhc.STREAM_READ,
        mhc.STREAM_WRITE,
        hc.HC_READ,
        hc.HC_WRITE,
    ]
    return {kernel.name: kernel for kernel in table}


def option_sections() -> dict[str, type]:
    """``model.<section>`` -> its options dataclass, for every design and the mixer."""
    sections: dict[str, type] = {}
    for component in [get_design(name) for name in _DESIGNS] + [mixer()]:
        if component.section is not None:
            sections.setdefault(component.section, component.options)
    return sections


def mixer_on(model) -> bool:
    """``model``: a ``ModelConfig``, or the ``model`` mapping of a saved config."""
    if isinstance(model, dict):
        return mixer().options(**(model.get(mixer().section) or {})).enabled()
    return getattr(model, mixer().section).enabled()


def components(model) -> list:
    """The residual design and, when on, the local mixer: what a model adds to `standard`."""
    return [get_design(model.residual)] + ([mixer()] if mixer_on(model) else [])


def sublayer_names(model) -> tuple[str, ...]:
    """The sublayers of every layer, in order (``SublayerResidual.position`` indexes them)."""
    return ((mixer().name,) if mixer_on(model) else ()) + ("attn", "mlp")


def variant_label(model) -> str:
    """``<design>`` or ``<design>+shortswa``, for a ``ModelConfig`` or a saved mapping."""
    design = model["residual"] if isinstance(model, dict) else model.residual
    return design + (f"+{mixer().name}" if mixer_on(model) else "")


def variant_overrides(variant: str, base) -> list[str]:
    """Config overrides selecting ``<design>`` or ``<design>+shortswa`` (mixer off or on).

    When on, the mixer keeps the window of ``base`` (a ``ModelConfig``) if it sets one, else
    gets the default window.
    """
    design, plus, extra = variant.partition("+")
    section = mixer().section
    if plus and extra != mixer().name:
        raise KeyError(f"{variant!r}: expected <design> or <design>+{mixer().name}")
    get_design(design)
    window = getattr(base, section).window or mixer().options.default_window
    return [f"model.residual={design}", f"model.{section}.window={window if plus else 0}"]


def resolve_aliases(model: dict, config_format: int) -> dict:
    """A raw ``model`` section with old spellings rewritten (configs and saved checkpoints).

    In config format 1 (checkpoints written before the mixer was an axis) the mixer's section
    only mattered with the old design name: with any other design the mixer was off.
    """
    section = model.get(mixer().section) or {}
    if not isinstance(section, dict):  # malformed: left for the config loader to name
        return model
    section = dict(section)
    if isinstance(model.get("residual"), str) and model["residual"] in _ALIASES:
        design, window = _ALIASES[model["residual"]]
        section["window"] = section.get("window") or window
        return dict(model, residual=design, **{mixer().section: section})
    if config_format < 2:
        section["window"] = 0
        return dict(model, **{mixer().section: section})
    return model
