"""Open the dataset's train and validation streams for this rank (readers only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from t2train.config.schema import Config
from t2train.parallel.init import Topology
from t2train.train.batches import is_reader


@dataclass
class Streams:
    train: Optional[object]  # TokenBatches on the replica's reading rank, else None
    val: Optional[object]

    def state_dict(self) -> Optional[dict]:
        """The train stream's position; streaming's state is global, so rank 0's suffices."""
        return self.train.state_dict() if self.train is not None else None


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
