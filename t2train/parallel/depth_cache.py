"""The depth cache: the rank-local store that lets a pipeline hop skip residual-state units
the receiving rank already holds (which units cross each hop: ``hop_plan.py``).

Depth reads need earlier layers' states, so a pipeline hop carries the residual stream's
units (named by the design's ``unit_ids``). With virtual stages, rank r runs chunks
r, r + P, r + 2P, ... on the same micro-batch; every unit that never changes and was in the
state rank r produced at the end of chunk c - P is still there when chunk c starts, so the
hop into chunk c need not carry it (the Attention Residuals paper's cache-based pipeline
communication, arXiv 2603.15031 Sec. 4.1). ``naive`` resends everything.

Gradients: the first chunk on a rank where a cacheable unit appears (produced there, or
received) owns it. Later chunks read a detached leaf whose gradient is deposited into the
unit's slot; the owner's copy adds the slot to its own gradient when its backward runs,
which the schedule guarantees is later (backward visits the chunks of a micro-batch in
reverse). No graph is traversed twice and the sent (deallocated) tensor is never cached.

"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor


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
