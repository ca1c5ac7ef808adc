"""Open the dataset's train and validation streams for this rank (readers only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from t2train.config.schema import Config
from t2train.parallel.init import Topology
from t2train.train.batches import is_reader


@dataclass
class Streams:
    train: Optional[object]  # TokenBatches on the replica's reading rank, else None
    val: Optional[object]

    def shared_state_dict(self) -> dict:
        """The train stream's position, known on every rank (collective).

        Streaming's state is global (samples seen by all readers), so rank 0's reader state
        resumes every reader, also under a different data-parallel size.
        """
        state = [self.train.state_dict() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(state, src=0)
        return state[0]


def open_streams(config: Config, topology: Topology, dp_size: int,
                 data_state: Optional[dict]) -> Streams:
    from t2train.data.loader import TokenBatches, reader_world

    reading = is_reader()
    world = reader_world(reading, topology.dp_rank, dp_size)
    if not reading:
        return Streams(None, None)
    common = dict(path=config.data.path, micro_batch_size=config.train.micro_batch_size,
                  seq_length=config.model.seq_length, world=world, seed=config.train.seed,
                  remote=config.data.remote, num_workers=config.data.num_workers)
    train = TokenBatches(split="train", shuffle=config.data.shuffle, **common)
    if data_state is not None:
        train.load_state_dict(data_state)
    val = TokenBatches(split="val", shuffle=False, **common)
    return Streams(train, val)
