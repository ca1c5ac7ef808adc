"""Open the dataset's train and validation streams, and the labelled validation sets
(``data.eval_sets``), for this rank (readers only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, cast

import torch.distributed as dist

from t2train.config.schema import Config, DataConfig
from t2train.parallel.init import Topology
from t2train.train.batches import is_reader

if TYPE_CHECKING:
    from t2train.data.loader import TokenBatches


@dataclass
class Streams:
    train: Optional[TokenBatches]  # on the replica's reading rank, else None
    val: Optional[TokenBatches]
    labelled: dict  # data.eval_sets: label -> TokenBatches of its val split (or None)

    def close(self) -> None:
        for stream in (self.train, self.val, *self.labelled.values()):
            if stream is not None:
                stream.close()

    def shared_state_dict(self) -> dict:
        """The train stream's position, known on every rank (collective).

        Streaming's state is global (samples seen by all readers), so rank 0's reader state
        resumes every reader, also under a different data-parallel size.
        """
        reader = self.train if dist.get_rank() == 0 else None  # rank 0 always reads
        state = [reader.state_dict() if reader is not None else None]
        dist.broadcast_object_list(state, src=0)
        return cast(dict, state[0])


def train_and_val_streams(data: DataConfig) -> tuple[list, list, dict]:
    """The datasets (``DataStream``s) to train and evaluate on: train on ``data.mix`` if set,
    else on ``data.path``; evaluate on ``data.path``'s val split, and on each labelled set's
    (label -> its stream). With ``data.cache_dir`` each local dataset is read through a cache
    there (its shards unpacked there)."""
    from t2train.data.streams import DataStream, unpacked_elsewhere  # noqa: PLC0415 - mosaicml-streaming: when the streams open

    def stream(path: str, weight=None) -> DataStream:
        if data.cache_dir:
            return unpacked_elsewhere(path, data.cache_dir, weight)
        return DataStream(path, data.remote if path == data.path else None, weight)

    main = stream(data.path)
    mixed = [stream(path, weight) for path, weight in data.mix_weights()]
    labelled = {label: stream(path) for label, path in data.labelled_eval_sets()}
    return mixed or [main], [main], labelled


def open_streams(
    config: Config, topology: Topology, dp_size: int, data_state: Optional[dict]
) -> Streams:
    from t2train.data.loader import TokenBatches, reader_world  # noqa: PLC0415 - mosaicml-streaming: when the streams open

    reading = is_reader()
    world = reader_world(reading, topology.dp_rank, dp_size)
    if not reading:
        return Streams(
            None, None, dict.fromkeys(label for label, _ in config.data.labelled_eval_sets())
        )
    train_streams, val_streams, labelled = train_and_val_streams(config.data)
    common = dict(
        micro_batch_size=config.train.micro_batch_size,
        seq_length=config.model.seq_length,
        world=world,
        seed=config.train.seed,
        num_workers=config.data.num_workers,
        num_canonical_nodes=config.data.num_canonical_nodes,
    )
    train = TokenBatches(
        train_streams,
        "train",
        shuffle=config.data.shuffle,
        step_samples=config.train.global_batch_size,
        **common,
    )
    if data_state is not None:
        train.load_state_dict(data_state)
    val = TokenBatches(val_streams, "val", shuffle=False, **common)
    return Streams(
        train,
        val,
        {
            label: TokenBatches([labelled[label]], "val", shuffle=False, **common)
            for label in labelled
        },
    )
