"""`standard`: the pre-norm additive residual, x <- x + f(Norm(x)).

The stream state is the hidden tensor [s, b, h]; one unit crosses each pipeline hop.
"""

from __future__ import annotations

from torch import Tensor

from t2train.residual.base import ResidualDesign, ResidualStream, SublayerResidual, no_extra


class AdditiveResidual(SublayerResidual):
    def read(self, state: Tensor) -> Tensor:
        return state

    def write(self, state: Tensor, x: Tensor, normed: Tensor, out: Tensor) -> Tensor:
        return state + out


class HiddenStateStream(ResidualStream):
    """The state is one [s, b, h] tensor, as in every Megatron model."""

    def enter(self, embedding: Tensor) -> Tensor:
        return embedding

    def exit(self, state: Tensor) -> Tensor:
        return state

    def to_units(self, state: Tensor) -> list[Tensor]:
        return [state]

    def from_units(self, units: list[Tensor], layers_done: int) -> Tensor:
        return units[0]


DESIGN = ResidualDesign(
    name="standard",
    stream=HiddenStateStream,
    sublayer=AdditiveResidual,
    reference="pre-norm residual (Xiong et al. 2020, arXiv 2002.04745)",
    extra_parameters=no_extra,
    extra_flops_per_token=no_extra,
)
