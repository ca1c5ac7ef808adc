"""Bytes the residual stream sends across pipeline hops, counted where they are packed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class HopTraffic:
    """One model chunk's pipeline traffic since the last reset.

    Forward bytes are counted by the sender; backward bytes (the gradient of a received
    hop, sent back by the receiver) by the receiver, only when it will run a backward.
    """

    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_hops: int = 0

    def sent(self, tensor: torch.Tensor) -> None:
        self.forward_bytes += tensor.numel() * tensor.element_size()
        self.forward_hops += 1

    def received(self, tensor: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            self.backward_bytes += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        self.forward_bytes = self.backward_bytes = self.forward_hops = 0


def collect_traffic(chunks) -> dict[str, float]:
    """Sum every rank's counters (collective) and reset them; the same dict on all ranks."""
    totals = torch.zeros(3, dtype=torch.float64)
    for chunk in chunks:
        traffic = chunk.module.decoder.traffic
        totals += torch.tensor([traffic.forward_bytes, traffic.backward_bytes,
                                traffic.forward_hops], dtype=torch.float64)
        traffic.reset()
    if torch.cuda.is_available():
        totals = totals.cuda()
    dist.all_reduce(totals)
    return {"pipeline/forward_bytes": float(totals[0]), "pipeline/backward_bytes": float(totals[1]),
            "pipeline/forward_hops": float(totals[2])}
