"""The training modules of `attnres` (the design and its math: ``__init__.py``)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from t2train.kernels import dispatch
from t2train.nn import probe
from t2train.nn.precision import at_least_fp32
from t2train.residual.attnres import sublayers_per_layer
from t2train.residual.base import ResidualStream, SublayerResidual, mark_replicated


class AttnResState(NamedTuple):
    sources: tuple  # embedding, then completed block sums (Full: every sublayer output)
    partial: Optional[Tensor]  # the current block's running sum (None at a block start)
    # Phase-1 results of the open block's later reads in this chunk, by sublayer index
    # (filled by the block's first read here; None: each read computes its own).
    reads: Optional[dict] = None

    def values(self) -> list[Tensor]:
        return list(self.sources) + ([self.partial] if self.partial is not None else [])


def _inverse_rms(x: Tensor, eps: float) -> Tensor:
    return torch.rsqrt(x.pow(2).mean(-1) + eps)


def _logits(queries: Tensor, xs: list[Tensor], eps: float) -> Tensor:
    """z [N, S, s, b]: each query [S, h] against each RMS-normalised source [s, b, h]. The
    RMSNorm is weight-free, so query . RMSNorm(v) = (query . v) rsqrt(mean(v^2) + eps) and
    the normalised keys are never materialised."""
    return torch.stack([(x @ queries.T).movedim(-1, 0) * _inverse_rms(x, eps) for x in xs])


def _mixtures(queries: Tensor, sources, eps: float) -> tuple[list[Tensor], Tensor]:
    """Each query's softmax mixture of the sources (S tensors [s, b, h]) and the logits z,
    in fp32 whatever the inputs' dtype or autocast.

    The sources stay separate tensors: stacking them copied every source on every read, and
    a weighted sum of the stack materialised [N, s, b, h] products (forward and backward);
    one multiply-add per source costs neither. (As a contraction over N the sum is a batched
    [1, N] x [N, h] matmul per token, which the CPU runs token by token.)"""
    xs = [at_least_fp32(v) for v in sources]
    z = _logits(queries.to(xs[0].dtype), xs, eps)
    weights = torch.softmax(z, dim=0).unsqueeze(-1)  # [N, S, s, b, 1]
    outs = []
    for query_weights in weights.unbind(1):
        out = query_weights[0] * xs[0]
        for weight, x in zip(query_weights[1:], xs[1:]):
            out = torch.addcmul(out, weight, x)
        outs.append(out)
    return outs, z


def depth_mix(query: Tensor, values: list[Tensor], eps: float) -> Tensor:
    """sum_i softmax_i(query . RMSNorm(v_i)) v_i over the sources (each [s, b, h]).

    Logits, softmax and sum in fp32 whatever the inputs' dtype or autocast."""
    with torch.autocast(values[0].device.type, enabled=False):
        [out], _ = _mixtures(query[None], values, eps)
        return out.to(values[0].dtype)


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


def mixing_weights(query: Tensor, values: list[Tensor], eps: float) -> Tensor:
    """The softmax weights of ``depth_mix`` [n_sources, s, b] (for diagnostics)."""
    with torch.autocast(values[0].device.type, enabled=False):
        return torch.softmax(_logits(query[None].float(), [v.float() for v in values], eps), dim=0)[
            :, 0
        ]


def block_phase_1(queries: Tensor, sources, eps: float) -> tuple[Tensor, Tensor]:
    """Phase 1 of Block AttnRes (arXiv 2603.15031 Sec. 4.2): S pseudo-queries [S, h] over the
    N completed sources (each [s, b, h]) at once, one read of the sources. O [S, s, b, h] is
    each query's mixture of the sources, LSE [S, s, b] its logsumexp (both fp32)."""
    with torch.autocast(sources[0].device.type, enabled=False):
        outs, z = _mixtures(queries, sources, eps)
        return torch.stack(outs), torch.logsumexp(z, dim=0)


def block_phase_2(partial: Tensor, query: Tensor, out: Tensor, lse: Tensor, eps: float) -> Tensor:
    """Phase 2: merge one query's phase-1 result with the block's partial sum p, the online
    softmax (e^LSE O + e^z_p p) / (e^LSE + e^z_p), in fp32; returned in p's dtype."""
    with torch.autocast(partial.device.type, enabled=False):
        p = at_least_fp32(partial)
        gamma = torch.sigmoid((p @ query.to(p.dtype)) * _inverse_rms(p, eps) - lse)
        return (out + gamma.unsqueeze(-1) * (p - out)).to(partial.dtype)


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
