"""Whether an optimizer update is applied: skipped on a non-finite loss or gradient, or on
an (optional) loss spike; decided on every rank alike, between backward and the update."""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

from t2train.config.schema import TrainConfig


class UpdateGuard:
    def __init__(self, train: TrainConfig):
        self.spike_factor = train.loss_spike_factor
        self.recent: deque[float] = deque(maxlen=train.loss_spike_window)

    def skip_reason(self, loss: float, grads_finite: bool) -> Optional[str]:
        """Why this step's update must be skipped, or None to apply it (and remember loss)."""
        if not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        if not grads_finite:
            return "non-finite gradients"
        if self.spike_factor and len(self.recent) == self.recent.maxlen:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.spike_factor * mean:
                return (
                    f"loss spike ({loss:.4f} > train.loss_spike_factor="
                    f"{self.spike_factor} x mean {mean:.4f} of the last {len(self.recent)})"
                )
        self.recent.append(loss)
        return None


def grads_not_finite(chunks) -> torch.Tensor:
    """Collective over all ranks: 1 (a one-element tensor on the device) if some gradient of
    the DDP chunks' buffers is not finite, else 0; not read back here.

    With the distributed optimizer a rank's buffer holds reduced gradients only for its own
    shard; a non-finite value anywhere still leaves some rank's buffer non-finite.
    """
    bad = torch.zeros(1, dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu")
    for chunk in chunks:
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            bad |= (~torch.isfinite(buffer.grad_data).all()).to(torch.int32)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad
