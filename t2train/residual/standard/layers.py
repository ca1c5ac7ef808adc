"""The training modules of `standard` (the design and its math: ``__init__.py``)."""

from __future__ import annotations

from torch import Tensor

from t2train.residual.base import ResidualStream, SublayerResidual


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


KERNELS = ()  # the fused kernels this design declares (the registry's kernel table)
