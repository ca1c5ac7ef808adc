"""The n-stream pieces `hc` and `mhc` share: the stream of n copies and a sublayer that
reads a mix of the streams and writes into all of them."""

from __future__ import annotations

from typing import Callable, Optional, cast

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
        self._handed_on: Optional[tuple] = None  # compiled: this read, made by the last write

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

    # Compiled (dynamic `hc`, `mhc`): each write computes the following sublayer's read with
    # it (the design's ``connect``, a write and a read as one function) and hands it on; a
    # layer's first read is computed alone.

    def handed_read(self, connect: Callable, state: Tensor, eps: float) -> tuple:
        """``connect``'s outputs for this sublayer's read: handed on by the write before it,
        or at a layer's first read computed alone (the state comes back through it)."""
        handed, self._handed_on = self._handed_on, None
        if handed is None:
            handed = connect(state, eps, read=self.read_part(), norm_eps=self.norm_eps())
        return handed

    def write_handing_on(self, connect: Callable, streams: Tensor, eps: float, write) -> Tensor:
        """The new streams of ``write`` (the design's ``Write``), with the following
        sublayer's read computed in the same function and handed on to it; the layer's last
        write alone."""
        following = cast(Optional[StreamMixResidual], self.following)
        if following is None:
            (new,) = connect(streams, eps, write=write)
            return new
        handed = connect(
            streams, eps, write=write, read=following.read_part(), norm_eps=following.norm_eps()
        )
        following._handed_on = handed
        return handed[0]

    def read_part(self):
        """The design's ``Read`` of this sublayer for ``connect``."""
        raise NotImplementedError

    def norm_eps(self) -> float:
        """The eps of this sublayer's pre-norm, which the read applies."""
        return cast(float, self.pre_norm.eps)


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
