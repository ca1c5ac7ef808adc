"""Bytes the residual stream sends across pipeline hops, counted where they are packed.

Per direction, two counts: *data* bytes, the units the receiver lacks, and *wire* bytes,
the hop tensors as sent, zero padding included (``parallel.hop_shapes=padded``; exact hops
carry no padding and no shape messages, ``t2train/parallel/hops.py``). The backward
direction carries the gradient of each hop tensor, the same shape as the forward tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.distributed as dist


@dataclass
class HopTraffic:
    """One model chunk's pipeline traffic since the last reset.

    Forward bytes are counted by the sender; backward bytes (the gradient of a received
    hop, sent back by the receiver) by the receiver, only when it will run a backward.
    """

    forward_data_bytes: int = 0
    forward_wire_bytes: int = 0
    backward_data_bytes: int = 0
    backward_wire_bytes: int = 0
    forward_hops: int = 0

    def sent(self, hop: torch.Tensor, data_units: int, wire_units: int) -> None:
        data, wire = _bytes(hop, data_units, wire_units)
        self.forward_data_bytes += data
        self.forward_wire_bytes += wire
        self.forward_hops += 1

    def received(self, hop: torch.Tensor, data_units: int, wire_units: int) -> None:
        if torch.is_grad_enabled():
            data, wire = _bytes(hop, data_units, wire_units)
            self.backward_data_bytes += data
            self.backward_wire_bytes += wire

    def reset(self) -> None:
        for field in fields(self):
            setattr(self, field.name, 0)


def _bytes(hop: torch.Tensor, data_units: int, wire_units: int) -> tuple[int, int]:
    """(data, wire) bytes of a hop tensor holding ``wire_units`` units, ``data_units`` real."""
    wire = hop.numel() * hop.element_size()
    return wire // wire_units * data_units, wire


def collect_traffic(chunks) -> Callable[[], dict[str, float]]:
    """Take this rank's counters (and reset them); the returned function sums them over all
    ranks (a collective: every rank calls it, in the same order) into the same dict on all.

    Keys ``pipeline/<field>``: forward and backward data and wire bytes, forward hops.
    """
    names = [field.name for field in fields(HopTraffic)]
    counts = [0] * len(names)
    for chunk in chunks:
        traffic = chunk.module.traffic
        counts = [count + getattr(traffic, name) for count, name in zip(counts, names)]
        traffic.reset()

    def sum_over_ranks() -> dict[str, float]:
        totals = torch.tensor(
            counts, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu"
        )
        dist.all_reduce(totals)
        return {f"pipeline/{name}": total for name, total in zip(names, totals.tolist())}

    return sum_over_ranks
