"""The n-stream pieces `hc` and `mhc` share: the stream of n copies and a sublayer that
reads a mix of the streams and writes into all of them."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from t2train.nn import probe
from t2train.residual.base import ResidualStream, SublayerResidual
from t2train.residual.functional import mean_of_streams
from t2train.residual.sublayers import sublayer_names


def sublayer_index(model, layer_number: int, position: int) -> int:
    """0-based index of a sublayer over the whole model (every sublayer counts)."""
    return len(sublayer_names(model)) * (layer_number - 1) + position


def record_weights(name: str, sublayer: tuple, read: Tensor, write: Tensor, mix) -> None:
    """Diagnostics of one hyper-connection: read weights [s, b, n], write weights [s, b, n]
    and ``mix()``, the stream mixing [s, b, n, n] as applied (new stream i = sum_j mix[i, j]
    h_j), summarised by its gain: the largest absolute row sum, averaged over tokens."""
    probe.record(f"{name}_read", sublayer, lambda: read)
    probe.record(f"{name}_write", sublayer, lambda: write)
    probe.record(f"{name}_gain", sublayer, lambda: mix().abs().sum(-1).amax(-1).mean())


class StreamMixResidual(SublayerResidual):
    """A sublayer that reads a mix of n streams and writes back into all of them.

    ``read`` computes the sublayer's connection weights once and keeps what ``write`` needs
    (the layer calls them in that order on the same state, also when recomputing).
    """

    def __init__(self, config, model, layer_number: int = 1, position: int = 0):
        super().__init__(config, model, layer_number, position)
        self._pending: Optional[tuple] = None  # the read's mappings, for the write

    def read(self, state: Tensor) -> Tensor:
        x, self._pending = self.width_connection(state)
        return x

    def write(self, state: Tensor, x: Tensor, normed: Tensor, out: Tensor) -> Tensor:
        if self._pending is None:
            raise RuntimeError(f"{type(self).__name__}.write without its read")
        pending, self._pending = self._pending, None
        return self.depth_connection(state, pending, out)

    def width_connection(self, state: Tensor) -> tuple[Tensor, tuple]:
        """The sublayer's input and what its write needs."""
        raise NotImplementedError

    def depth_connection(self, state: Tensor, pending: tuple, out: Tensor) -> Tensor:
        raise NotImplementedError


class StreamCopies(ResidualStream):
    """n streams [n, s, b, h]: the embedding enters as n copies, the final norm reads their
    mean; a hop carries the n streams as n units."""

    section = "hc"  # where the expansion rate is configured

    def __init__(self, config, model, pre_process: bool, post_process: bool, first_layer: int):
        super().__init__(config, model, pre_process, post_process, first_layer)
        self.n = getattr(self.model, self.section).expansion_rate

    def enter(self, embedding: Tensor) -> Tensor:
        return embedding.unsqueeze(0).expand(self.n, *embedding.shape)

    def exit(self, state: Tensor) -> Tensor:
        return mean_of_streams(state)

    def to_units(self, state: Tensor) -> list[Tensor]:
        return list(state.unbind(0))

    def from_units(self, units: list[Tensor], layers_done: int) -> Tensor:
        return torch.stack(units)
