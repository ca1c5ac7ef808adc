"""One global batch per step, read once per data-parallel replica and shared with its peers.

Only the replica's first-stage, tensor-rank-0 process reads the stream. At the start of each
step it pulls the step's micro-batches and broadcasts them over the replica's model-parallel
group, so tensor-parallel peers and both pipeline ends see identical tokens, and no
broadcast is pending while the pipeline schedule runs (which would deadlock 1F1B).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from t2train.engine import MicroBatch
from t2train.parallel.init import current_device


def is_reader() -> bool:
    return (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_pipeline_model_parallel_rank() == 0
    )


def _reader_rank_in(group) -> int:
    flags: list[tuple[int, bool]] = [(0, False)] * dist.get_world_size(group)
    dist.all_gather_object(flags, (dist.get_rank(), is_reader()), group=group)
    readers = [rank for rank, reading in flags if reading]
    if len(readers) != 1:
        raise RuntimeError(f"expected one data reader per model-parallel group, found {readers}")
    return readers[0]


class GlobalBatchFeeder:
    """Hands each step's micro-batches to every rank of a data-parallel replica."""

    def __init__(
        self,
        loader: Optional[Iterator[MicroBatch]],
        num_microbatches: int,
        micro_batch_size: int,
        seq_length: int,
    ):
        if is_reader() and loader is None:
            raise ValueError("the reading rank needs a loader")
        self.loader = loader if is_reader() else None
        self.shape = (num_microbatches, 2, micro_batch_size, seq_length)
        self.group = parallel_state.get_model_parallel_group()
        self.shared = dist.get_world_size(self.group) > 1
        self.src = _reader_rank_in(self.group) if self.shared else dist.get_rank()
        self.device = current_device()

    def next_step(self) -> list[MicroBatch]:
        if self.loader is not None:
            # Reading leaves the training RNG alone: torch's DataLoader draws a base seed from
            # the global generator whenever an iterator starts (the first batch, each epoch),
            # which would shift dropout's stream by where a run started (a resumed run draws
            # after its RNG was restored, the uninterrupted one before its first step).
            with torch.random.fork_rng(devices=[]):
                micro_batches = [next(self.loader) for _ in range(self.shape[0])]
            stacked = torch.stack(
                [torch.stack((mb["tokens"], mb["labels"])) for mb in micro_batches]
            )
            stacked = stacked.to(self.device, torch.int64)
        else:
            stacked = torch.empty(self.shape, dtype=torch.int64, device=self.device)
        if self.shared:
            dist.broadcast(stacked, src=self.src, group=self.group)
        return [{"tokens": mb[0], "labels": mb[1]} for mb in stacked]
