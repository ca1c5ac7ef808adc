"""The interfaces every residual design (and the local mixer) provides.

A decoder layer is a sequence of pre-norm sublayers: the local mixer when it is on (ShortSWA,
``model.shortswa.window > 0``), attention, and the MLP. Where a standard Transformer computes
``x = x + f(norm(x))``, t2train asks the residual design:

* ``SublayerResidual.read(state)``: the tensor the sublayer normalises and transforms;
* ``SublayerResidual.write(state, x, normed, out)``: the stream state after the sublayer
  (``normed`` is the pre-norm of ``x``; the norm itself is ``pre_norm``);
* ``ResidualDesign.layer_entry`` (optional): a module whose ``begin(state)`` runs once per
  layer before its sublayers, e.g. the depth-wise attention read.

``ResidualStream`` owns the state between layers: it turns the embedding into the initial
state (``enter``), reads the final hidden state for the last norm (``exit``), and splits the
state into [s, b, h] units (``to_units``/``from_units``) for pipeline hops and activation
recompute, in the order the design's declaration names them (``ResidualDesign.unit_ids``),
and may reshape the state between layers, outside compiled code (``between_layers``).

Everything else a design needs is in its declaration (``ResidualDesign``,
``declaration.py``): its config section (``options``, read from ``model.<section>``), the
rules it adds to the config, its parameter and FLOP counts, and how its diagnostics are
written. Nothing outside ``t2train/residual/`` names a design (``tests/test_design_names.py``).
"""

from __future__ import annotations

from typing import Any, Optional

from megatron.core.transformer.module import MegatronModule
from torch import Tensor

State = Any  # a design's stream state: a Tensor for `standard`, richer for others


class SublayerResidual(MegatronModule):
    """How one sublayer reads from and writes to the residual stream.

    ``model`` is the run's ``ModelConfig`` (the design reads its options there, e.g.
    ``model.hc``, typed in ``options.py``; ``config`` is Megatron's). ``position`` is the
    sublayer's index within its layer (``sublayer_names(model)``: the mixer first when it is
    on, then attention, then the MLP).
    """

    def __init__(self, config, model, layer_number: int = 1, position: int = 0):
        super().__init__(config=config)
        self.model = model
        self.layer_number = layer_number
        self.position = position

    def attach_pre_norm(self, norm) -> None:
        """The norm the layer applies to ``read(state)`` before the sublayer, for a write
        that recomputes from ``x`` what the norm made (``ddl``'s gate in compiled code). The
        layer owns it: kept as a reference, not a submodule, so that its weight stays one
        parameter of the layer's."""
        self._pre_norm = (norm,)

    @property
    def pre_norm(self):
        return self._pre_norm[0]

    def attach_following(self, following: "Optional[SublayerResidual]") -> None:
        """The residual of the sublayer that reads the state this one writes, within the
        layer (None for the layer's last), for a write that also computes the next read
        (``hc`` in compiled code). A reference, as ``attach_pre_norm``'s."""
        self._following = (following,)

    @property
    def following(self) -> "Optional[SublayerResidual]":
        return self._following[0]

    def read(self, state: State) -> Tensor:
        raise NotImplementedError

    def read_normed(self, state: State, norm) -> tuple[Tensor, Tensor]:
        """The sublayer's input x = ``read(state)`` and ``norm(x)``, what the sublayer reads.
        A design whose read applies the norm itself overrides it (compiled dynamic `hc`:
        the norm's backward joins the read's, and x is rebuilt rather than kept)."""
        x = self.read(state)
        return x, norm(x)

    def write(self, state: State, x: Tensor, normed: Tensor, out: Tensor) -> State:
        raise NotImplementedError


class ResidualStream(MegatronModule):
    """The stream state between layers and across pipeline hops, for one model chunk.

    ``first_layer`` is the 0-based global index of the chunk's first layer, so a chunk
    knows which depth states exist when its input arrives; ``model`` is the run's
    ``ModelConfig``.
    """

    # Earlier tokens' embeddings that ``enter`` reads for each token (a causal convolution
    # over tokens); 0: each token's state starts from its own embedding alone.
    entry_context: int = 0

    def __init__(self, config, model, pre_process: bool, post_process: bool, first_layer: int):
        super().__init__(config=config)
        self.model = model
        self.pre_process = pre_process
        self.post_process = post_process
        self.first_layer = first_layer

    def connect(self, sublayers: list[SublayerResidual]) -> None:
        """Called once with this chunk's sublayer residuals, in the order they run (a design
        whose reads share work across sublayers links them here)."""

    def enter(self, embedding: Tensor) -> State:
        raise NotImplementedError

    def exit(self, state: State) -> Tensor:
        raise NotImplementedError

    def between_layers(self, state: State) -> State:
        """The state after a layer, as the next layer gets it. Runs eagerly between compiled
        layers: a design whose state grows with depth moves what the layer added into a
        preallocated buffer here, so that every layer is compiled for the same structure."""
        return state

    def to_units(self, state: State) -> list[Tensor]:
        """The state as [s, b, h] units, in the order of the design's ``unit_ids``."""
        raise NotImplementedError

    def from_units(self, units: list[Tensor], layers_done: int) -> State:
        """Inverse of ``to_units`` for the state after ``layers_done`` layers (global count)."""
        raise NotImplementedError


def mark_replicated(module, config) -> None:
    """Parameters held whole by every tensor-parallel rank, applied per token.

    Under sequence parallelism each rank sees a different slice of tokens, so
    ``finalize_model_grads`` must all-reduce these gradients across tensor ranks.
    """
    for param in module.parameters():
        param.sequence_parallel = config.sequence_parallel
