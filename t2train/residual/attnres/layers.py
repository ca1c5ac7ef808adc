"""The training modules of `attnres` (the design and its math: ``__init__.py``)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from t2train.kernels import dispatch
from t2train.nn import probe
from t2train.residual.attnres import sublayers_per_layer
from t2train.residual.attnres.functional import (
    block_phase_1,
    block_phase_2,
    depth_mix,
    mixing_weights,
)
from t2train.residual.base import ResidualStream, SublayerResidual, mark_replicated


class AttnResState(NamedTuple):
    sources: tuple  # embedding, then completed block sums (Full: every sublayer output)
    partial: Optional[Tensor]  # the current block's running sum (None at a block start)
    # Phase-1 results of the open block's later reads in this chunk, by sublayer index
    # (filled by the block's first read here; None: each read computes its own).
    reads: Optional[dict] = None

    def values(self) -> list[Tensor]:
        return list(self.sources) + ([self.partial] if self.partial is not None else [])


def mix_sources(query: Tensor, sources, partial: Optional[Tensor], eps: float) -> Tensor:
    """``depth_mix`` over the sources and the open block's partial sum (if any), through the
    two-phase Triton kernel where ``T2_KERNELS`` routes it."""
    values = list(sources) + ([] if partial is None else [partial])
    mix = dispatch.route(DEPTH_MIX, query, *values)
    return mix(query, list(sources), partial, eps)


def mix_with_partial(query: Tensor, sources: list, partial: Optional[Tensor], eps: float) -> Tensor:
    """``depth_mix`` over the sources and the partial sum, taking the arguments of the fused
    kernel (``DEPTH_MIX``) that computes it in two phases."""
    return depth_mix(query, sources + ([] if partial is None else [partial]), eps)


DEPTH_MIX = dispatch.Kernel("depth_mix", "t2train.kernels.depth_mix:depth_mix", mix_with_partial)
BLOCK_PHASE_1 = dispatch.Kernel("block_phase_1", "t2train.kernels.depth_mix:phase_1", block_phase_1)
BLOCK_PHASE_2 = dispatch.Kernel("block_phase_2", "t2train.kernels.depth_mix:phase_2", block_phase_2)


def _pseudo_query(config) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(config.hidden_size, dtype=config.params_dtype))


class BlockAttnResidual(SublayerResidual):
    """Block AttnRes: read the mixture; add the output to the block's partial sum.

    The reads of one block share their sources (embedding and completed blocks), so the
    block's first read in a chunk runs phase 1 for itself and the block's later reads in the
    chunk at once (``block_mates``, set by the stream's ``connect``); each read then merges
    its row with the partial sum (phase 2).
    """

    def __init__(self, config, model, layer_number: int = 1, position: int = 0):
        super().__init__(config, model, layer_number, position)
        self.query = _pseudo_query(config)
        self.eps = self.model.attnres.eps
        per_layer = sublayers_per_layer(self.model)
        self.index = per_layer * (layer_number - 1) + position  # 0-based, global
        self.block_size = self.model.attnres.block_size
        self.block_mates = [self]  # this and the block's later reads in the chunk, in order
        mark_replicated(self, config)

    def read(self, state: AttnResState) -> Tensor:
        values = state.values()
        probe.record(
            "attnres", self.index, lambda: mixing_weights(self.query, values, self.eps).mean((1, 2))
        )
        out, lse = self._phase_1_row(state)
        if state.partial is None:
            return out.to(state.sources[0].dtype)
        phase_2 = dispatch.route(BLOCK_PHASE_2, state.partial, out)
        return phase_2(state.partial, self.query, out, lse, self.eps)

    def _phase_1_row(self, state: AttnResState) -> tuple[Tensor, Tensor]:
        """This read's phase-1 result, computed with its block mates' if not yet done."""
        if state.reads is not None and self.index in state.reads:
            return state.reads.pop(self.index)
        mates = self.block_mates if state.reads is not None else [self]
        queries = torch.stack([mate.query for mate in mates])
        phase_1 = dispatch.route(BLOCK_PHASE_1, queries, *state.sources)
        out, lse = phase_1(queries, list(state.sources), self.eps)
        rows = {mate.index: (out[i], lse[i]) for i, mate in enumerate(mates)}
        row = rows.pop(self.index)
        if state.reads is not None:
            state.reads.update(rows)
        return row

    def write(self, state: AttnResState, x: Tensor, normed: Tensor, out: Tensor) -> AttnResState:
        partial = out if state.partial is None else state.partial + out
        if (self.index + 1) % self.block_size == 0:
            return AttnResState(state.sources + (partial,), None, {})
        return AttnResState(state.sources, partial, state.reads)


class FullAttnResidual(BlockAttnResidual):
    """Full AttnRes: every sublayer output is a source of its own, so a read has no partial
    sum to merge and no block mates: one mixture (no logsumexp for a phase 2)."""

    def read(self, state: AttnResState) -> Tensor:
        probe.record(
            "attnres",
            self.index,
            lambda: mixing_weights(self.query, list(state.sources), self.eps).mean((1, 2)),
        )
        return mix_sources(self.query, state.sources, None, self.eps)

    def write(self, state: AttnResState, x: Tensor, normed: Tensor, out: Tensor) -> AttnResState:
        return AttnResState(state.sources + (out,), None, {})


class AttnResStream(ResidualStream):
    """Units [sources..., partial]: sources (ids 0, 1, ...) never change; the partial does."""

    def __init__(
        self,
        config,
        model,
        pre_process: bool,
        post_process: bool,
        first_layer: int,
        block_size: Optional[int] = None,
    ):
        super().__init__(config, model, pre_process, post_process, first_layer)
        self.block_size = block_size or self.model.attnres.block_size
        self.eps = self.model.attnres.eps
        self.per_layer = sublayers_per_layer(self.model)
        if post_process:
            self.final_query = _pseudo_query(config)
        mark_replicated(self, config)

    def connect(self, sublayers: list) -> None:
        """Each read learns the later reads of its block in this chunk (its phase-1 batch)."""
        for i, read in enumerate(sublayers):
            read.block_mates = [
                mate
                for mate in sublayers[i:]
                if mate.index // self.block_size == read.index // self.block_size
            ]

    def enter(self, embedding: Tensor) -> AttnResState:
        return AttnResState((embedding,), None, {})

    def exit(self, state: AttnResState) -> Tensor:
        values = state.values()
        final = self.per_layer * self.config.num_layers  # numbered after the last sublayer
        probe.record(
            "attnres",
            final,
            lambda: mixing_weights(self.final_query, values, self.eps).mean((1, 2)),
        )
        return mix_sources(self.final_query, state.sources, state.partial, self.eps)

    def to_units(self, state: AttnResState) -> list[Tensor]:
        return state.values()

    def from_units(self, units: list[Tensor], layers_done: int) -> AttnResState:
        if (self.per_layer * layers_done) % self.block_size:
            return AttnResState(tuple(units[:-1]), units[-1], {})
        return AttnResState(tuple(units), None, {})


class FullAttnResStream(AttnResStream):
    def __init__(self, config, model, pre_process: bool, post_process: bool, first_layer: int):
        super().__init__(config, model, pre_process, post_process, first_layer, block_size=1)


KERNELS = (
    DEPTH_MIX,
    BLOCK_PHASE_1,
    BLOCK_PHASE_2,
)  # the fused kernels this design declares (the registry's kernel table)
