"""The depth cache: which residual-state units cross each pipeline hop, and the rank-local
store that lets a hop skip units the receiving rank already holds.

Depth reads need earlier layers' states, so a pipeline hop carries the residual stream's
units (see ``ResidualStream.unit_ids``). With virtual stages, rank r runs chunks
r, r + P, r + 2P, ... on the same micro-batch; every unit that never changes and was in the
state rank r produced at the end of chunk c - P is still there when chunk c starts, so the
hop into chunk c need not carry it (the Attention Residuals paper's cache-based pipeline
communication, arXiv 2603.15031 Sec. 4.1). ``naive`` resends everything.

Gradients: the first chunk on a rank where a cacheable unit appears (produced there, or
received) owns it. Later chunks read a detached leaf whose gradient is deposited into the
unit's slot; the owner's copy adds the slot to its own gradient when its backward runs,
which the schedule guarantees is later (backward visits the chunks of a micro-batch in
reverse). No graph is traversed twice and the sent (deallocated) tensor is never cached.

The run's ``HopPlan`` is made once, by ``plan_hops`` (``engine/megatron/setup.py`` and
``t2train/model/build.py``), and handed to every decoder chunk and to the step; ``t2train
plan`` makes it the same way, so its byte predictions are those of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from t2train.residual import get_design


@dataclass(frozen=True)
class HopPlan:
    """Which unit ids cross the hop into each chunk, and how many units each hop puts on the
    wire, for a layout, a transfer mode and a hop-shape mode.

    ``shapes``: ``exact`` sends each hop with just its own units (the schedule is told each
    receive's size, ``t2train/parallel/hops.py``); ``padded`` zero-pads every hop to the
    layout's largest, the one shape Megatron's schedules send by default.
    """

    unit_ids: Callable[[int], list]  # (layers_done) -> ids, the stream's ``unit_ids``
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


def plan_hops(tf_config) -> HopPlan:
    """The run's hop plan, from its Megatron config (a ``T2TransformerConfig``: the layout,
    ``t2_model``, ``t2_cached_hops``, ``t2_hop_shapes``).

    The stream that names the units is built without its first and last chunks' modules, so
    making the plan creates no parameters and draws no random numbers."""
    stream = get_design(tf_config.t2_model.residual).modules().stream(tf_config, False, False, 0)
    pipeline = tf_config.pipeline_model_parallel_size
    chunks = pipeline * (tf_config.virtual_pipeline_model_parallel_size or 1)
    return HopPlan(
        stream.unit_ids,
        pipeline,
        chunks,
        tf_config.num_layers // chunks,
        cached=tf_config.t2_cached_hops,
        shapes=tf_config.t2_hop_shapes,
        unit_rows=unit_rows(
            tf_config.t2_model.seq_length,
            tf_config.tensor_model_parallel_size,
            tf_config.sequence_parallel,
        ),
    )


class _AddSlotGradient(torch.autograd.Function):
    """Identity whose backward adds the gradient later chunks deposited in ``slot``."""

    @staticmethod
    def forward(ctx, tensor: Tensor, slot: list) -> Tensor:
        ctx.slot = slot
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor):
        deposited = ctx.slot[0]
        return (grad if deposited is None else grad + deposited), None


@dataclass
class _Entry:
    tensor: Tensor  # the owner's copy (before its gradient augmentation)
    slot: list = field(default_factory=lambda: [None])


class DepthCache:
    """Units this rank holds, per micro-batch, shared by all its virtual-stage chunks."""

    def __init__(self) -> None:
        self._store: dict[int, dict[int, _Entry]] = {}

    def holds(self, micro_batch: int, uid: Optional[int]) -> bool:
        return uid is not None and uid in self._store.get(micro_batch, {})

    def own(self, micro_batch: int, uid: int, tensor: Tensor) -> Tensor:
        """Register the owner's copy; use the returned tensor downstream in its chunk."""
        entry = _Entry(tensor.detach())
        self._store.setdefault(micro_batch, {})[uid] = entry
        if not tensor.requires_grad:
            return tensor
        return _AddSlotGradient.apply(tensor, entry.slot)

    def read(self, micro_batch: int, uid: int) -> Tensor:
        """A later chunk's copy: a leaf whose gradient goes to the owner's slot."""
        entry = self._store[micro_batch][uid]
        leaf = entry.tensor.detach().requires_grad_(torch.is_grad_enabled())
        if leaf.requires_grad:
            leaf.register_hook(lambda grad, slot=entry.slot: _deposit(slot, grad))
        return leaf

    def drop(self, micro_batch: int) -> None:
        """Forget a micro-batch once no later chunk on this rank will read it."""
        self._store.pop(micro_batch, None)

    def clear(self) -> None:
        self._store.clear()

    def __len__(self) -> int:
        return sum(len(units) for units in self._store.values())


def _deposit(slot: list, grad: Tensor) -> None:
    slot[0] = grad if slot[0] is None else slot[0] + grad
