"""Which residual-state units cross each pipeline hop: the run's ``HopPlan``.

A hop into a chunk carries the units of the stream state the chunk needs (named by the
design's ``ResidualDesign.unit_ids``), less the ones the receiving rank kept from its previous
chunk when the depth cache is on (``depth_cache.py``). The plan is made once, by
``plan_hops`` (``engine/megatron/setup.py`` and ``t2train/model/build.py``), and handed to
every decoder chunk and to the step; ``t2train plan`` makes it the same way without importing
torch, so its byte predictions are those of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from t2train.config.schema import Config
from t2train.residual import get_design


@dataclass(frozen=True)
class HopPlan:
    """Which unit ids cross the hop into each chunk, and how many units each hop puts on the
    wire, for a layout, a transfer mode and a hop-shape mode.

    ``shapes``: ``exact`` sends each hop with just its own units (the schedule is told each
    receive's size, ``t2train/parallel/hops.py``); ``padded`` zero-pads every hop to the
    layout's largest, the one shape Megatron's schedules send by default.
    """

    unit_ids: Callable[[int], list]  # (layers_done) -> ids, the design's ``unit_ids``
    pipeline: int
    chunks: int  # pipeline * virtual stages
    layers_per_chunk: int
    cached: bool
    shapes: str = "exact"
    unit_rows: int = 0  # rows of one unit on the wire (``unit_rows``); 0: not planned

    def held(self, chunk: int) -> set:
        """Ids the rank running ``chunk`` kept from its previous chunk of the micro-batch."""
        if not self.cached or chunk < self.pipeline:
            return set()
        boundary = (chunk - self.pipeline + 1) * self.layers_per_chunk
        return {uid for uid in self.unit_ids(boundary) if uid is not None}

    def sent_ids(self, chunk: int) -> list:
        """Ids carried by the hop into ``chunk`` (None: a changing unit, always sent)."""
        held = self.held(chunk)
        return [
            uid
            for uid in self.unit_ids(chunk * self.layers_per_chunk)
            if uid is None or uid not in held
        ]

    def hop_units(self) -> list[int]:
        """Units of data each hop carries, hops into chunks 1 .. chunks-1."""
        return [len(self.sent_ids(c)) for c in range(1, self.chunks)]

    @property
    def padded_units(self) -> int:
        """The largest hop of the layout: what every hop carries when padded."""
        return max([1] + self.hop_units())

    def wire_units(self, chunk: int) -> int:
        """Units on the wire into ``chunk``: its data, zero-padded unless shapes are exact."""
        return len(self.sent_ids(chunk)) if self.shapes == "exact" else self.padded_units

    def wire_hop_units(self) -> list[int]:
        return [self.wire_units(c) for c in range(1, self.chunks)]

    @property
    def shapes_vary(self) -> bool:
        """Whether hops go out at different sizes, so the schedule must be told each
        receive's shape (``t2train/parallel/hops.py``)."""
        return len(set(self.wire_hop_units())) > 1


def unit_rows(seq_length: int, tensor: int, sequence_parallel: bool) -> int:
    """Rows (tokens) of one hop unit: the sequence, split over the tensor ranks when they
    hold sequence-parallel slices of it."""
    return seq_length // tensor if sequence_parallel else seq_length


def plan_hops(config: Config) -> HopPlan:
    """The run's hop plan: the design's units (``ResidualDesign.unit_ids``) over the
    config's layout, transfer mode (``parallel.depth_cache``) and hop shapes."""
    model, parallel = config.model, config.parallel
    chunks = parallel.pipeline * parallel.virtual_pipeline
    return HopPlan(
        partial(get_design(model.residual).unit_ids, model),
        parallel.pipeline,
        chunks,
        model.num_layers // chunks,
        cached=parallel.caches_depth_units(),
        shapes=parallel.hop_shapes,
        unit_rows=unit_rows(model.seq_length, parallel.tensor, parallel.sequence_parallel),
    )
