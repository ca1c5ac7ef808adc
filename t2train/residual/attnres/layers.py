"""The training modules of `attnres` (the design and its math: ``__init__.py``)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from t2train.kernels import dispatch
from t2train.nn import probe
from t2train.nn.compiling import replace_fields
from t2train.residual.attnres import completed_sources, sources, sublayers_per_layer
from t2train.residual.attnres.functional import (
    block_phase_1,
    block_phase_2,
    depth_mix,
    mixing_weights,
)
from t2train.residual.base import ResidualStream, SublayerResidual, mark_replicated


class AttnResState(NamedTuple):
    buffer: Tensor  # the chunk's store of completed sources (``sources.py``)
    earlier: Tensor  # [n, s, b, h]: the sources earlier layers made, rows of ``buffer``
    new: tuple = ()  # sources this layer made, moved into ``buffer`` after the layer
    partial: Optional[Tensor] = None  # the open block's running sum (None at a block start)
    reads: tuple = ()  # phase-1 (O, LSE) of the open block's next reads in this chunk, in order

    def stacks(self) -> list[Tensor]:
        """The completed sources (embedding, then block sums; Full: every sublayer output) as
        stacks [k, s, b, h]: the earlier layers' rows, then this layer's own."""
        return _stacks(self.earlier, self.new)

    def with_partial(self) -> list[Tensor]:
        """The stacks and the open block's partial sum: every value a read mixes."""
        return _with_partial(self.stacks(), self.partial)


def _stacks(earlier: Tensor, new) -> list[Tensor]:
    """The earlier sources' stack, then each new source as a stack of one."""
    return [earlier] + [source.unsqueeze(0) for source in new]


def _with_partial(stacks: list[Tensor], partial: Optional[Tensor]) -> list[Tensor]:
    return stacks + ([] if partial is None else [partial.unsqueeze(0)])


def mix_sources(
    query: Tensor, stacks: list[Tensor], partial: Optional[Tensor], eps: float
) -> Tensor:
    """``depth_mix`` over the sources and the open block's partial sum (if any), through the
    two-phase Triton kernel where ``T2_KERNELS`` routes it."""
    values = stacks + ([] if partial is None else [partial])
    mix = dispatch.route(DEPTH_MIX, query, *values)
    return mix(query, stacks, partial, eps)


def mix_with_partial(
    query: Tensor, stacks: list[Tensor], partial: Optional[Tensor], eps: float
) -> Tensor:
    """``depth_mix`` over the sources and the partial sum, taking the arguments of the fused
    kernel (``DEPTH_MIX``) that computes it in two phases."""
    return depth_mix(query, _with_partial(stacks, partial), eps)


def phase_1_handing_on(
    queries: Tensor, earlier: Tensor, new: list[Tensor], eps: float, rounded: bool = False
) -> tuple:
    """``block_phase_1``'s O (each query's, a tuple) and LSE over the earlier sources (a
    stack [k, ..., h]) and the new ones (each [..., h]), then those as they came, for the
    layer to hand on: the kernel then adds the gradient each gets after the read in the
    read's backward, where autograd would add it in a pass of its own, and reads each O's
    gradient where it is."""
    out, lse = block_phase_1(queries, _stacks(earlier, new), eps, rounded)
    return (tuple(out.unbind(0)), lse, earlier, *new)


def phase_2_handing_on(
    partial: Tensor, query: Tensor, out: Tensor, lse: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``block_phase_2``'s merge, then the partial sum as it came, for the layer to hand on
    (the write adds the output to it): the kernel then adds the gradient the partial sum
    gets after the read in the read's backward."""
    return block_phase_2(partial, query, out, lse, eps), partial


DEPTH_MIX = dispatch.Kernel("depth_mix", "t2train.kernels.depth_mix:depth_mix", mix_with_partial)
BLOCK_PHASE_1 = dispatch.Kernel(
    "block_phase_1", "t2train.kernels.depth_mix:phase_1_handing_on", phase_1_handing_on
)
BLOCK_PHASE_2 = dispatch.Kernel(
    "block_phase_2", "t2train.kernels.depth_mix:phase_2_handing_on", phase_2_handing_on
)


def _pseudo_query(config) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(config.hidden_size, dtype=config.params_dtype))


class BlockAttnResidual(SublayerResidual):
    """Block AttnRes: read the mixture; add the output to the block's partial sum.

    The reads of one block share their sources (embedding and completed blocks), so the
    block's first read in a chunk runs phase 1 for itself and the block's later reads in the
    chunk at once (``block_mates``, set by the stream's ``connect``); each read then merges
    its row with the partial sum (phase 2). The later reads' rows travel in the state, in
    order, so a read never needs to know its index (a compiled layer would specialise on it).
    """

    def __init__(self, config, model, layer_number: int = 1, position: int = 0):
        super().__init__(config, model, layer_number, position)
        self.query = _pseudo_query(config)
        self.eps = self.model.attnres.eps
        per_layer = sublayers_per_layer(self.model)
        self.index = per_layer * (layer_number - 1) + position  # 0-based, global
        self.block_size = self.model.attnres.block_size
        self.closes_block = (self.index + 1) % self.block_size == 0
        self.block_mates = [self]  # this and the block's later reads in the chunk, in order
        self._later_reads: tuple = ()  # the read's leftover phase-1 rows, for the write
        self._handed_on: dict = {}  # state fields as the read handed them on (phases 1, 2)
        mark_replicated(self, config)

    def read(self, state: AttnResState) -> Tensor:
        probe.record(
            "attnres",
            self.index,
            lambda: mixing_weights(self.query, state.with_partial(), self.eps).mean((1, 2)),
        )
        (out, lse), self._later_reads = self._phase_1_rows(state)
        if state.partial is None:
            return out.to(state.earlier.dtype)
        phase_2 = dispatch.route(BLOCK_PHASE_2, state.partial, out)
        merged, partial = phase_2(state.partial, self.query, out, lse, self.eps)
        self._hand_on(partial=partial)
        return merged

    def _phase_1_rows(self, state: AttnResState) -> tuple[tuple, tuple]:
        """This read's phase-1 (O, LSE) and its later block mates', computed if not yet done
        (the earlier sources then handed on through it)."""
        if state.reads:
            return state.reads[0], state.reads[1:]
        queries = torch.stack([mate.query for mate in self.block_mates])
        outs, lse = self._phase_1(queries, state)
        rows = tuple(zip(outs, lse.unbind(0)))
        return rows[0], rows[1:]

    def _phase_1(self, queries: Tensor, state: AttnResState) -> tuple[tuple, Tensor]:
        """Phase 1 over the state's sources, which it hands on (kept for the write): each
        query's O (a tensor of its own) and the LSE [S, ...]."""
        phase_1 = dispatch.route(BLOCK_PHASE_1, queries, state.earlier, *state.new)
        outs, lse, earlier, *new = phase_1(
            queries, state.earlier, list(state.new), self.eps, rounded=True
        )
        self._hand_on(earlier=earlier, new=tuple(new))
        return outs, lse

    def _hand_on(self, **fields) -> None:
        # a new dict: a compiled layer returns the values put into a dict that outlives it
        # (as outputs of its graph, whose gradients its backward then adds)
        self._handed_on = {**self._handed_on, **fields}

    def _handing_on(self, state: AttnResState) -> AttnResState:
        """The state with the values this read handed on (the sources if it ran phase 1, the
        partial sum if it ran phase 2)."""
        handed_on, self._handed_on = self._handed_on, {}
        return replace_fields(state, **handed_on) if handed_on else state

    def write(self, state: AttnResState, x: Tensor, normed: Tensor, out: Tensor) -> AttnResState:
        state = self._handing_on(state)
        reads, self._later_reads = self._later_reads, ()
        partial = out if state.partial is None else state.partial + out
        if self.closes_block:
            return replace_fields(state, new=state.new + (partial,), partial=None, reads=())
        return replace_fields(state, partial=partial, reads=reads)


class FullAttnResidual(BlockAttnResidual):
    """Full AttnRes: every sublayer output is a source of its own, so a read has no partial
    sum to merge and no block mates: one mixture (no logsumexp for a phase 2)."""

    def read(self, state: AttnResState) -> Tensor:
        probe.record(
            "attnres",
            self.index,
            lambda: mixing_weights(self.query, state.stacks(), self.eps).mean((1, 2)),
        )
        out, _ = self._phase_1(self.query[None], state)
        return out[0]

    def write(self, state: AttnResState, x: Tensor, normed: Tensor, out: Tensor) -> AttnResState:
        state = self._handing_on(state)
        return replace_fields(state, new=state.new + (out,))


class AttnResStream(ResidualStream):
    """Units [sources..., partial]: sources (ids 0, 1, ...) never change; the partial does.

    The completed sources live in one buffer per chunk and micro-batch (``sources.py``):
    ``between_layers`` moves each layer's new ones into it.
    """

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
        self.capacity = completed_sources(self.per_layer * self.model.num_layers, self.block_size)
        if post_process:
            self.final_query = _pseudo_query(config)
        mark_replicated(self, config)

    def connect(self, sublayers: list) -> None:
        """Each read learns the later reads of its block in this chunk (its phase-1 batch);
        the buffer holds the sources up to the chunk's end."""
        for i, read in enumerate(sublayers):
            read.block_mates = [
                mate
                for mate in sublayers[i:]
                if mate.index // self.block_size == read.index // self.block_size
            ]
        self.capacity = completed_sources(
            self.per_layer * self.first_layer + len(sublayers), self.block_size
        )

    def enter(self, embedding: Tensor) -> AttnResState:
        return AttnResState(*sources.start([embedding], self.capacity))

    def between_layers(self, state: AttnResState) -> AttnResState:
        earlier = sources.extend(state.buffer, state.earlier, state.new)
        return replace_fields(state, earlier=earlier, new=())

    def exit(self, state: AttnResState) -> Tensor:
        final = self.per_layer * self.config.num_layers  # numbered after the last sublayer
        probe.record(
            "attnres",
            final,
            lambda: mixing_weights(self.final_query, state.with_partial(), self.eps).mean((1, 2)),
        )
        return mix_sources(self.final_query, state.stacks(), state.partial, self.eps)

    def to_units(self, state: AttnResState) -> list[Tensor]:
        partial = [] if state.partial is None else [state.partial]
        return list(state.earlier.unbind(0)) + list(state.new) + partial

    def from_units(self, units: list[Tensor], layers_done: int) -> AttnResState:
        open_block = (self.per_layer * layers_done) % self.block_size != 0
        completed = units[:-1] if open_block else units
        buffer, earlier = sources.start(completed, self.capacity)
        return AttnResState(buffer, earlier, partial=units[-1] if open_block else None)


class FullAttnResStream(AttnResStream):
    def __init__(self, config, model, pre_process: bool, post_process: bool, first_layer: int):
        super().__init__(config, model, pre_process, post_process, first_layer, block_size=1)


KERNELS = (
    DEPTH_MIX,
    BLOCK_PHASE_1,
    BLOCK_PHASE_2,
)  # the fused kernels this design declares (the registry's kernel table)
