"""``attnres`` and ``block_attnres`` for the Hugging Face export: Attention Residuals
(arXiv 2603.15031), on [batch, seq, hidden].

An export part (``t2train/residual/hf.py`` says how it is assembled); its parameters are
named as in ``layers.py``, its math is ``functional.py``'s.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from t2train.residual.attnres.functional import depth_mix
from t2train.residual.hf_modeling import Stream, T2TrainConfig


class AttnResState(NamedTuple):
    sources: tuple  # the embedding, then completed blocks (Full: every sublayer output)
    partial: Optional[Tensor]  # the open block's running sum

    def stacks(self) -> list[Tensor]:
        """The sources and the open block as stacks of one (``depth_mix``'s arguments)."""
        values = list(self.sources) + ([self.partial] if self.partial is not None else [])
        return [v.unsqueeze(0) for v in values]


class AttnResStream(Stream):
    """Sources start with the embedding; the final norm reads a mixture with its own query."""

    def __init__(self, config: T2TrainConfig):
        super().__init__()
        self.eps = config.residual_options["eps"]
        self.final_query = nn.Parameter(torch.zeros(config.hidden_size))

    def enter(self, embedding: Tensor) -> AttnResState:
        return AttnResState((embedding,), None)

    def exit(self, state: AttnResState) -> Tensor:
        return depth_mix(self.final_query, state.stacks(), self.eps)


class BlockAttnResidual(nn.Module):
    """Each sublayer reads a mixture of the sources and the open block; its output joins the
    block, which becomes a source after ``block_size`` sublayers (counted over the model)."""

    def __init__(self, config: T2TrainConfig, layer: int, position: int):
        super().__init__()
        self.eps = config.residual_options["eps"]
        self.block_size = config.residual_options["block_size"]
        self.index = len(config.sublayers()) * layer + position
        self.query = nn.Parameter(torch.zeros(config.hidden_size))

    def read(self, state: AttnResState) -> Tensor:
        return depth_mix(self.query, state.stacks(), self.eps)

    def write(self, state: AttnResState, x: Tensor, normed: Tensor, out: Tensor) -> AttnResState:
        partial = out if state.partial is None else state.partial + out
        if (self.index + 1) % self.block_size == 0:
            return AttnResState(state.sources + (partial,), None)
        return AttnResState(state.sources, partial)


class FullAttnResidual(BlockAttnResidual):
    """Every sublayer output is a source of its own."""

    def write(self, state: AttnResState, x: Tensor, normed: Tensor, out: Tensor) -> AttnResState:
        return AttnResState(state.sources + (out,), None)


# model.residual -> (stream, sublayer residual, layer entry or None)
EXPORTED = {
    "attnres": (AttnResStream, FullAttnResidual, None),
    "block_attnres": (AttnResStream, BlockAttnResidual, None),
}
