"""The training-side reader: micro-batches of a prepared dataset for one data-parallel replica.

Under tensor/pipeline parallelism only one process per data-parallel replica reads (the
trainer broadcasts its batches to the replica's other ranks), so the world mosaicml-streaming
must partition samples over is the *data-parallel* world of the readers, not the global one.

How mosaicml-streaming 0.13 learns its world, and how this module overrides it:

* It reads the environment variables RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, not
  torch.distributed, and not only at construction: ``StreamingDataset()`` reads them
  (``World.detect``), so does ``clean_stale_shared_memory()`` (which rank cleans), and
  ``StreamingDataLoader.state_dict()`` reads them again (it multiplies this rank's sample count
  by WORLD_SIZE). ``streaming_env`` sets them to the readers' world for every call into
  streaming and restores them afterwards, so the trainer's own environment stays untouched.
* It calls ``torch.distributed.barrier()`` on the *default* group while constructing a dataset
  (three times) and while cleaning shared memory (once). When only some ranks read, the others
  never enter those barriers and the readers hang. ``streaming_env`` routes those barriers to
  a group of the readers only (``StreamingWorld.group``, made by ``reader_world``).
"""

from __future__ import annotations

import functools
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from streaming import StreamingDataLoader, StreamingDataset
from streaming.base.util import clean_stale_shared_memory

from t2train.data.errors import DataError
from t2train.data.prepare import read_index

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_shm_cleaned = False  # stale shared memory is cleaned once per process (see _clean_stale_shm)


@dataclass(frozen=True)
class StreamingWorld:
    """The world mosaicml-streaming sees: data-parallel readers, ranked by data-parallel rank.

    ``local_rank``/``local_world_size`` count the readers on this host, which must hold
    consecutive ranks. ``group`` is a torch.distributed group of exactly the readers, for
    streaming's barriers; None means the default group, which is right only when every
    process reads (or torch.distributed is not initialized).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group: Optional[Any] = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not (0 <= self.rank < self.world_size and 0 <= self.local_rank < self.local_world_size
                and self.world_size % self.local_world_size == 0):
            raise ValueError(f"inconsistent {self}: need 0 <= rank < world_size, 0 <= local_rank "
                             "< local_world_size, and world_size a multiple of local_world_size")


@contextmanager
def streaming_env(world: StreamingWorld) -> Iterator[None]:
    """Make mosaicml-streaming see ``world`` (env vars and barriers) inside the block."""
    saved = {key: os.environ.get(key) for key in _ENV}
    os.environ.update(RANK=str(world.rank), WORLD_SIZE=str(world.world_size),
                      LOCAL_RANK=str(world.local_rank),
                      LOCAL_WORLD_SIZE=str(world.local_world_size))
    barrier = dist.barrier
    if world.group is not None:
        dist.barrier = functools.partial(barrier, group=world.group)
    try:
        yield
    finally:
        dist.barrier = barrier
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def reader_world(is_reader: bool, dp_rank: int, dp_size: int,
                 group=None) -> Optional[StreamingWorld]:
    """The streaming world of this process if it reads data, else None.

    A collective: every rank of ``group`` (default: all ranks) must call it. Readers must be
    exactly one per data-parallel rank, consecutive ranks on each host, and the same number on
    every host (streaming's layout). Without torch.distributed it is a world of one.
    """
    if not dist.is_initialized():
        if dp_size != 1:
            raise ValueError(f"dp_size={dp_size} but torch.distributed is not initialized; "
                             "expected dp_size=1 in a single process")
        return StreamingWorld(0, 1, 0, 1) if is_reader else None
    entries: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(entries, (socket.gethostname(), bool(is_reader), dp_rank,
                                     dist.get_rank()), group=group)
    readers = sorted((e for e in entries if e[1]), key=lambda e: e[2])
    if [e[2] for e in readers] != list(range(dp_size)):
        raise ValueError(f"expected one data reader per data-parallel rank 0..{dp_size - 1}, "
                         f"got readers at data-parallel ranks {[e[2] for e in readers]}")
    hosts: dict[str, list[int]] = {}
    for host, _, rank, _ in readers:
        hosts.setdefault(host, []).append(rank)
    for host, ranks in hosts.items():
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise ValueError(f"data readers on host {host} have data-parallel ranks {ranks}; "
                             "mosaicml-streaming needs each host's readers to be consecutive")
    if len({len(ranks) for ranks in hosts.values()}) != 1:
        raise ValueError("hosts have different numbers of data readers "
                         f"{ {h: len(r) for h, r in hosts.items()} }; mosaicml-streaming needs "
                         "the same number on every host")
    if not is_reader:
        return None
    readers_group = None
    if len(readers) != dist.get_world_size():  # only readers call this (local synchronization)
        readers_group = dist.new_group([e[3] for e in readers], use_local_synchronization=True)
    local = hosts[socket.gethostname()]
    return StreamingWorld(dp_rank, dp_size, local.index(dp_rank), len(local), readers_group)


class TokenBatches:
    """Micro-batches ``{"tokens", "labels"}`` (int64 ``[micro_batch_size, seq_length]``) of one
    split, for one data-parallel replica; ``labels`` are ``tokens`` shifted by one.

    By default it never ends (a new epoch follows each one) and drops the last partial batch, so
    every batch has the same shape; ``state_dict()``/``load_state_dict()`` resume exactly.
    ``finite=True`` yields one pass (last batch possibly smaller) per ``for`` loop, for
    validation. ``remote`` (an object-store URL of a prepared dataset) streams shards into
    ``path``, which then acts as the local cache and must hold the dataset's index.json.
    """

    def __init__(self, path: str | Path, split: str, micro_batch_size: int, seq_length: int,
                 world: StreamingWorld, seed: int, shuffle: bool = True,
                 remote: Optional[str] = None, num_workers: int = 0, finite: bool = False):
        index = read_index(path)
        if split not in index["splits"]:
            raise DataError(f"dataset {path}: no split {split!r} (has "
                            f"{', '.join(index['splits'])})")
        if seq_length > index["seq_length"]:
            raise DataError(f"seq_length={seq_length}: needs samples of {seq_length + 1} tokens, "
                            f"but the samples of {path} have {index['seq_length'] + 1} tokens "
                            f"(prepared with seq_length={index['seq_length']})")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size}: must be >= 1")
        self.where = f"{path}/{split}"
        self.samples = index["splits"][split]["samples"]
        self.micro_batch_size, self.seq_length = micro_batch_size, seq_length
        self.world, self.finite = world, finite
        with streaming_env(world):
            _clean_stale_shm()
            self.dataset = StreamingDataset(
                local=str(Path(path) / split),
                remote=f"{remote.rstrip('/')}/{split}" if remote else None,
                shuffle=shuffle, shuffle_seed=seed, batch_size=micro_batch_size)
            self.loader = StreamingDataLoader(self.dataset, batch_size=micro_batch_size,
                                              num_workers=num_workers, drop_last=not finite,
                                              collate_fn=_stack_tokens)
        self._batches: Optional[Iterator[dict]] = None  # the current pass (epoch)

    def __iter__(self) -> "TokenBatches":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        with streaming_env(self.world):
            # At most: the current pass ends, a pass resumed at its very end is empty, and a
            # fresh pass must then yield, unless the split is too small for one micro-batch.
            for _ in range(3):
                if self._batches is None:
                    self._batches = iter(self.loader)
                batch = next(self._batches, None)
                if batch is not None:
                    return self._shift(batch)
                self._batches = None
                if self.finite:
                    raise StopIteration
        raise DataError(f"{self.where}: {self.samples} samples give no full micro-batch of "
                        f"{self.micro_batch_size} per data-parallel reader ("
                        f"{self.world.world_size} readers); lower the micro-batch size or add data")

    def state_dict(self) -> dict:
        """The position in the stream (global: the same on every reader)."""
        with streaming_env(self.world):
            return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` with the next batch (streaming applies it at the next pass)."""
        with streaming_env(self.world):
            self.loader.load_state_dict(state)
        self._batches = None

    def _shift(self, samples: torch.Tensor) -> dict[str, torch.Tensor]:
        samples = samples.to(torch.int64)  # stored as uint16/uint32
        return {"tokens": samples[:, :self.seq_length].contiguous(),
                "labels": samples[:, 1:self.seq_length + 1].contiguous()}


def _stack_tokens(samples: list[dict]) -> torch.Tensor:
    """One ``[batch, sample_length]`` tensor (a writable copy of streaming's read-only arrays)."""
    return torch.from_numpy(np.stack([sample["tokens"] for sample in samples]))


def _clean_stale_shm() -> None:
    """Remove shared memory left by killed runs, once per process, before its first dataset.

    Not again later: ``clean_stale_shared_memory`` unlinks every streaming segment on the host,
    including those of this process's live datasets (and of any other streaming job running
    on the same host at that moment). It is best effort: it stops at the first prefix number
    with nothing left over, and streaming never deletes its ``/tmp/<prefix>_*_filelock`` files,
    so each run takes new, higher prefixes and leftovers above them can stay.
    """
    global _shm_cleaned
    if not _shm_cleaned:
        clean_stale_shared_memory()
        _shm_cleaned = True
