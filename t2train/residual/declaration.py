"""What a residual design (and the local mixer) declares: its name, config section and
options, config rules, parameter and FLOP counts, diagnostics, and where its training modules
are (``layers``). A declaration imports neither torch nor Megatron-core: the config, the
planner and the CLI read it without building a model (``tests/test_deferred_import.py``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Protocol


class DesignModules(NamedTuple):
    """A design's training modules (``t2train/residual/base.py`` says what each does)."""

    stream: type  # ResidualStream
    sublayer: type  # SublayerResidual
    layer_entry: Optional[type]  # a module whose begin(state) runs before the sublayers


class DiagnosticsWriter(Protocol):
    """What a design's diagnostics writer may emit (``t2train/monitor/diagnostics.py``)."""

    def scalars(self, step: int, values: dict) -> None: ...

    def histogram(self, step: int, tag: str, values) -> None: ...

    def heatmap(
        self,
        step: int,
        tag: str,
        matrix,
        rows: list,
        columns: list,
        title: str,
        xlabel: str,
        ylabel: str,
    ) -> None: ...


def no_extra(_model_config) -> int:
    return 0


class SavedPerToken(NamedTuple):
    """Numbers one layer keeps for its backward beyond a `standard` layer's, per token and
    averaged over the model's layers (what the design's reads, writes and stream add, its
    entry included), as the compiled layer keeps them. Each tensor rank holds ``whole``
    numbers in full (sequence parallelism splits them over tokens); ``split`` ones are split
    over tensor ranks like attention's heads."""

    whole: float = 0.0  # in the activation dtype
    whole_fp32: float = 0.0
    split: float = 0.0  # in the activation dtype
    split_fp32: float = 0.0


def nothing_saved(_model_config) -> SavedPerToken:
    return SavedPerToken()


def scaled_output(model) -> SavedPerToken:
    """Under selective recompute: the output of a layer's last sublayer (the MLP's second
    GEMM), which a write that scales it by a learned weight reads again for that weight's
    gradient; the other sublayers' outputs are attention projections, kept anyway."""
    return SavedPerToken(whole=model.hidden_size)


class Traffic(NamedTuple):
    """[tokens, hidden] activation units a sublayer call reads and writes, forward and
    backward (``t2train bench bytes`` counts what the compiled layer moves against it)."""

    forward: float
    backward: float


# A sublayer body (attention, the MLP, the mixer) seen from the stream: forward, it reads its
# normed input and writes its output; backward, the input-gradient GEMM reads the output's
# gradient and writes the input's, the weight-gradient GEMM reads the output's gradient and
# the input. The same for every design.
BODY = Traffic(forward=2, backward=4)


def one_changing_unit(_model_config, _layers_done: int) -> list:
    return [None]


def no_rules(_config) -> None:
    return None


def no_diagnostics(_writer: DiagnosticsWriter, _step: int, _records: dict, _model) -> None:
    return None


@dataclass(frozen=True)
class ResidualDesign:
    """A named residual operator: its modules, config section, cost model and source.

    Counts take the ``ModelConfig`` (the local mixer adds a sublayer per layer, which a
    design that works per sublayer also pays for); ``tensor_parallel_parameters`` is the part
    of ``extra_parameters`` split across tensor-parallel ranks (for the planner).
    ``saved_per_token`` is the activation memory the design adds to a layer (for the planner;
    ``tests/bench/test_plan_memory.py`` checks it against what the compiled layers save).
    ``minimum_traffic`` is the memory traffic its formula needs (``t2train bench bytes``
    and ``tests/bench/test_byte_account.py`` hold the compiled layers to it).

    ``unit_ids(model, layers_done)`` names the [s, b, h] units of the stream state after
    ``layers_done`` layers (global count), in the order of the stream's ``to_units``: an id
    for a unit that never changes once made (an earlier layer's state, an AttnRes source),
    which a rank may keep and not receive again (the depth cache), None for one that changes.
    Pipeline hops are planned from it (``t2train/parallel/hop_plan.py``).
    """

    name: str
    layers: str  # the module of its training modules, imported when a model is built
    stream: str  # names in ``layers``: the ResidualStream, the SublayerResidual
    sublayer: str
    reference: str
    extra_parameters: Callable = no_extra
    extra_flops_per_token: Callable = no_extra
    tensor_parallel_parameters: Callable = no_extra
    saved_per_token: Callable = nothing_saved  # (ModelConfig) -> SavedPerToken, for the planner
    # (ModelConfig) -> SavedPerToken: what a layer keeps under model.recompute=selective
    # beyond its input state and `standard`'s GEMM and attention outputs (``selective_saved``)
    selective_saved_per_token: Optional[Callable] = None
    # (ModelConfig, 0-based layer index) -> Traffic: what a sublayer call of that layer must
    # read and write at least (each tensor its formula needs, once per pass), BODY included
    minimum_traffic: Optional[Callable] = None
    unit_ids: Callable = one_changing_unit
    layer_entry: Optional[str] = None  # in ``layers``: begin(state) runs before the sublayers
    section: Optional[str] = None  # its options live in model.<section> (shared by siblings)
    options: Optional[type] = None  # dataclass with validate(prefix); one per section
    check: Callable = no_rules  # (Config) -> None: rules across sections, ConfigError if broken
    write_diagnostics: Callable = no_diagnostics  # (writer, step, records, ModelConfig)
    # Inductor options its compiled layers take beyond ``INLINE_LIMITS``
    # (``t2train/nn/compiling.py``; ``t2train bench bytes`` lowers with the same)
    inductor_options: Optional[dict] = None

    def selective_saved(self, model) -> SavedPerToken:
        """``selective_saved_per_token``; a design without one is planned at its
        ``saved_per_token``, an upper bound (recomputed, a read or write keeps no more)."""
        declared = self.selective_saved_per_token or self.saved_per_token
        return declared(model)

    def modules(self) -> DesignModules:
        """The training modules (imports ``layers``: torch and Megatron-core)."""
        module = importlib.import_module(self.layers)
        entry = getattr(module, self.layer_entry) if self.layer_entry else None
        return DesignModules(getattr(module, self.stream), getattr(module, self.sublayer), entry)


@dataclass(frozen=True)
class LocalMixer:
    """A sequence-axis sublayer placed before attention in every layer, combinable with every
    residual design: its output is written to the stream through the design's operator."""

    name: str
    section: str
    layers: str  # the module of its training modules
    options: Any  # dataclass with validate(prefix), enabled() and a default_window
    spec: str  # in ``layers``: (its options) -> ModuleSpec of the sublayer
    reference: str
    extra_parameters: Callable = no_extra
    extra_flops_per_token: Callable = no_extra
    tensor_parallel_parameters: Callable = no_extra
    check: Callable = no_rules
    write_diagnostics: Callable = no_diagnostics

    def module_spec(self, model):
        """The sublayer's ModuleSpec for ``model``'s options (imports ``layers``: torch and
        Megatron-core)."""
        return getattr(importlib.import_module(self.layers), self.spec)(
            getattr(model, self.section)
        )
