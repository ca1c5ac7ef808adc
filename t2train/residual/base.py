"""The two pieces every residual design provides.

A decoder layer is a sequence of pre-norm sublayers (attention, MLP). Where a standard
Transformer computes ``x = x + f(norm(x))``, t2train asks the design:

* ``SublayerResidual.read(state)``: the tensor the sublayer normalises and transforms;
* ``SublayerResidual.write(state, x, normed, out)``: the stream state after the sublayer.

``ResidualStream`` owns the state between layers: it turns the embedding into the initial
state (``enter``), reads the final hidden state for the last norm (``exit``), and packs the
state into the single tensor Megatron's pipeline schedules send between stages
(``send``/``receive``, ``hop_units`` tensors of [s, b, h] each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.module import MegatronModule
from torch import Tensor

State = Any  # a design's stream state: a Tensor for `standard`, richer for others


class SublayerResidual(MegatronModule):
    """How one sublayer reads from and writes to the residual stream."""

    def read(self, state: State) -> Tensor:
        raise NotImplementedError

    def write(self, state: State, x: Tensor, normed: Tensor, out: Tensor) -> State:
        raise NotImplementedError


class ResidualStream(MegatronModule):
    """The stream state between layers and across pipeline hops, for one model chunk."""

    hop_units: int = 1  # [s, b, h] tensors packed into one pipeline hop

    def enter(self, embedding: Tensor) -> State:
        raise NotImplementedError

    def exit(self, state: State) -> Tensor:
        raise NotImplementedError

    def send(self, state: State) -> Tensor:
        raise NotImplementedError

    def receive(self, packed: Tensor) -> State:
        raise NotImplementedError


@dataclass(frozen=True)
class ResidualDesign:
    """A named residual design: its stream, its per-sublayer operator and its source."""

    name: str
    stream: type
    sublayer: type
    reference: str
