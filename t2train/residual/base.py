"""The pieces every residual design provides.

A decoder layer is a sequence of pre-norm sublayers (attention, MLP, and for some designs
an extra one). Where a standard Transformer computes ``x = x + f(norm(x))``, t2train asks
the design:

* ``SublayerResidual.read(state)``: the tensor the sublayer normalises and transforms;
* ``SublayerResidual.write(state, x, normed, out)``: the stream state after the sublayer;
* ``LayerEntry.begin(state)`` (optional): work done once per layer before its sublayers,
  e.g. the depth-wise attention read.

``ResidualStream`` owns the state between layers: it turns the embedding into the initial
state (``enter``), reads the final hidden state for the last norm (``exit``), and splits the
state into [s, b, h] units (``to_units``/``from_units``) for pipeline hops and activation
recompute. ``unit_ids`` names each unit: an id for a unit that never changes once made
(an earlier layer's state, an AttnRes source), which a rank may keep and not receive again
(the depth cache, ``t2train/parallel/depth_cache.py``); None for one that changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron.core.transformer.module import MegatronModule
from torch import Tensor

State = Any  # a design's stream state: a Tensor for `standard`, richer for others


class SublayerResidual(MegatronModule):
    """How one sublayer reads from and writes to the residual stream.

    ``position`` is the sublayer's index within its layer (attention 0, MLP 1; a design
    with an extra sublayer numbers it first).
    """

    def __init__(self, config, layer_number: int = 1, position: int = 0):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.position = position

    def read(self, state: State) -> Tensor:
        raise NotImplementedError

    def write(self, state: State, x: Tensor, normed: Tensor, out: Tensor) -> State:
        raise NotImplementedError


class ResidualStream(MegatronModule):
    """The stream state between layers and across pipeline hops, for one model chunk.

    ``first_layer`` is the 0-based global index of the chunk's first layer, so a chunk
    knows which depth states exist when its input arrives.
    """

    def __init__(self, config, pre_process: bool, post_process: bool, first_layer: int):
        super().__init__(config=config)
        self.pre_process = pre_process
        self.post_process = post_process
        self.first_layer = first_layer

    def unit_ids(self, layers_done: int) -> list:
        """Ids of the state's units after ``layers_done`` layers (None: changes per layer)."""
        return [None]


    def enter(self, embedding: Tensor) -> State:
        raise NotImplementedError

    def exit(self, state: State) -> Tensor:
        raise NotImplementedError

    def to_units(self, state: State) -> list[Tensor]:
        """The state as [s, b, h] units, in ``unit_ids`` order."""
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


@dataclass(frozen=True)
class ResidualDesign:
    """A named residual design: its modules, its cost model and its source."""

    name: str
    stream: type
    sublayer: type
    reference: str
    extra_parameters: Callable  # (ModelConfig) -> parameters beyond `standard`
    extra_flops_per_token: Callable  # (ModelConfig) -> forward FLOPs beyond `standard`
    layer_entry: Optional[type] = None  # LayerEntry run before a layer's sublayers
    pre_attention: Optional[Callable] = None  # () -> ModuleSpec of an extra first sublayer


def no_extra(_model_config) -> int:
    return 0
