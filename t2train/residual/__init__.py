"""Residual-stream designs (``model.residual``) and the local mixer (``model.shortswa``).

Two independent choices make a model's residual stream:

* the residual operator, ``model.residual``: how each sublayer reads its input from the stream
  and writes its output back, and what the stream carries (a ``ResidualDesign``);
* the local mixer: a sequence-axis ShortSWA sublayer before attention, on when
  ``model.shortswa.window > 0``, written through the chosen operator like any sublayer.

A combination is labelled ``<design>`` or ``<design>+shortswa`` (``variant_label``); the
same spelling selects it in ``t2train bench step`` and ``t2train experiment compare``.

A design is a folder here: ``<design>/__init__.py`` declares it (a ``ResidualDesign``: its
options, config rules, counts and diagnostics; light, no torch), ``<design>/layers.py``
holds its training modules and the ``Kernel`` declarations of its fused kernels
(``KERNELS``), ``<design>/hf.py`` its export part and ``<design>/benchmarks.py`` its
kernels' benchmark cases. Adding one: the checklist in ``README.md`` beside this file, which
the tests enforce. Shared pieces: ``declaration.py`` (what a design declares), ``base.py``
(the module interfaces), ``sublayers.py`` (the mixer switch and the sublayer order),
``streams.py`` (the n-stream pieces `hc` and `mhc` share), ``window_attention.py`` (the
window-attention operator of the mixer and `depth_attn`).
"""

from __future__ import annotations

import importlib
import importlib.util

from t2train.residual.declaration import ResidualDesign
from t2train.residual.sublayers import mixer as mixer
from t2train.residual.sublayers import mixer_on as mixer_on
from t2train.residual.sublayers import sublayer_names as sublayer_names

_DESIGNS = {  # name -> (folder package, its declaration)
    "standard": ("t2train.residual.standard", "DESIGN"),
    "ddl": ("t2train.residual.ddl", "DESIGN"),
    "depth_attn": ("t2train.residual.depth_attn", "DESIGN"),
    "attnres": ("t2train.residual.attnres", "FULL"),
    "block_attnres": ("t2train.residual.attnres", "BLOCK"),
    "hc": ("t2train.residual.hc", "DESIGN"),
    "mhc": ("t2train.residual.mhc", "DESIGN"),
}
BASELINE = "standard"  # the default design, and the one benchmarks compare against
# Old spellings: name -> (design, window the mixer gets when the config leaves it at 0).
_ALIASES = {"shortswa": ("standard", 128)}  # shortswa was a design of its own (config format 1)


def registered() -> tuple[str, ...]:
    return tuple(_DESIGNS)


def design_folder(name: str) -> str:
    """The package (folder) of design ``name``: its declaration; ``.layers``, ``.hf``."""
    return _DESIGNS[name][0]


def get_design(name: str) -> ResidualDesign:
    """The ``ResidualDesign`` registered under ``name``."""
    if name not in _DESIGNS:
        raise KeyError(
            f"model.residual={name!r}: unknown residual design, choose one of {sorted(_DESIGNS)}"
        )
    module, attribute = _DESIGNS[name]
    return getattr(importlib.import_module(module), attribute)


def kernel_table() -> dict:
    """The kernel table: every fused Triton kernel by name, a ``t2train.kernels.dispatch.
    Kernel`` (name, Triton function, PyTorch reference) declared once beside its reference:
    the shared ones, then each design's and the mixer's ``layers.KERNELS``. The dispatch
    routes each declaration; the tests and ``t2train.bench.kernels`` read this."""
    from t2train.nn import precision  # noqa: PLC0415 - torch: not for the config's readers
    from t2train.residual import window_attention  # noqa: PLC0415 - torch: not for the config's readers

    table = [window_attention.WINDOW_ATTENTION, precision.FP32_LINEAR]
    for layers in _layers_modules():
        table += importlib.import_module(layers).KERNELS
    return {kernel.name: kernel for kernel in table}


def _layers_modules() -> list[str]:
    """The training-module module of every design and of the mixer, once each (one folder
    may hold two designs)."""
    return list(dict.fromkeys([get_design(name).layers for name in _DESIGNS] + [mixer().layers]))


def kernel_benchmarks() -> dict:
    """Benchmark name (``python -m t2train.bench.kernels --only``) -> (its case builder,
    the kernels of the table it times), from each folder's ``benchmarks.BENCHMARKS``."""
    found: dict = {}
    for folder in (layers.rpartition(".")[0] for layers in _layers_modules()):
        if importlib.util.find_spec(f"{folder}.benchmarks") is not None:
            found.update(importlib.import_module(f"{folder}.benchmarks").BENCHMARKS)
    return found


def components(model) -> list:
    """The residual design and, when on, the local mixer: what a model adds to `standard`."""
    return [get_design(model.residual)] + ([mixer()] if mixer_on(model) else [])


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
