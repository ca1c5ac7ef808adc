"""The training-side reader: micro-batches of a prepared dataset for one data-parallel replica.

Under tensor/pipeline parallelism only one process per data-parallel replica reads (the
trainer broadcasts its batches to the replica's other ranks), so the world mosaicml-streaming
must partition samples over is the *data-parallel* world of the readers, not the global one.

How mosaicml-streaming 0.13 learns its world, and how this module overrides it:

* It reads the environment variables RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, not
  torch.distributed, and not only at construction: ``StreamingDataset()`` reads them
  (``World.detect``), and ``StreamingDataLoader.state_dict()`` reads them again (it
  multiplies this rank's sample count by WORLD_SIZE). ``streaming_env`` sets them to the
  readers' world for every call into streaming and restores them afterwards, so the trainer's
  own environment stays untouched.
* It calls ``torch.distributed.barrier()`` on the *default* group while constructing a dataset
  (three times). When only some ranks read, the others
  never enter those barriers and the readers hang. ``streaming_env`` routes those barriers to
  a group of the readers only (``StreamingWorld.group``, made by ``reader_world``).
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, cast

import numpy as np
import torch
import torch.distributed as dist
from streaming import StreamingDataLoader
from streaming.base.dataset import _ShardState
from streaming.base.hashing import get_hash, is_hash

from t2train.compat.streaming_prefix import (
    prefix_chosen_by_the_leader,
    prefix_probes_closed_when_dropped,
)
from t2train.compat.streaming_resume import ResumeFromObject
from t2train.data.errors import DataError
from t2train.data.shm import clean_stale_streaming_files, release_shared_memory
from t2train.data.streams import DataStream, split_streams

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_host_cleaned = False  # stale streaming files are cleaned once per process (_clean_stale_files)


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
        if not (
            0 <= self.rank < self.world_size
            and 0 <= self.local_rank < self.local_world_size
            and self.world_size % self.local_world_size == 0
        ):
            raise ValueError(
                f"inconsistent {self}: need 0 <= rank < world_size, 0 <= local_rank "
                "< local_world_size, and world_size a multiple of local_world_size"
            )


@contextmanager
def streaming_env(world: StreamingWorld) -> Iterator[None]:
    """Make mosaicml-streaming see ``world`` (env vars and barriers) inside the block."""
    saved = {key: os.environ.get(key) for key in _ENV}
    os.environ.update(
        RANK=str(world.rank),
        WORLD_SIZE=str(world.world_size),
        LOCAL_RANK=str(world.local_rank),
        LOCAL_WORLD_SIZE=str(world.local_world_size),
    )
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


def reader_world(is_reader: bool, dp_rank: int, dp_size: int) -> Optional[StreamingWorld]:
    """The streaming world of this process if it reads data, else None.

    A collective: every rank must call it (it may create a group). Readers must be
    exactly one per data-parallel rank, consecutive ranks on each host, and the same number on
    every host (streaming's layout). Without torch.distributed it is a world of one.
    """
    if not dist.is_initialized():
        if dp_size != 1:
            raise ValueError(
                f"dp_size={dp_size} but torch.distributed is not initialized; "
                "expected dp_size=1 in a single process"
            )
        return StreamingWorld(0, 1, 0, 1) if is_reader else None
    entries: list = [None] * dist.get_world_size()
    dist.all_gather_object(
        entries, (socket.gethostname(), bool(is_reader), dp_rank, dist.get_rank())
    )
    readers = sorted((e for e in entries if e[1]), key=lambda e: e[2])
    if [e[2] for e in readers] != list(range(dp_size)):
        raise ValueError(
            f"expected one data reader per data-parallel rank 0..{dp_size - 1}, "
            f"got readers at data-parallel ranks {[e[2] for e in readers]}"
        )
    hosts: dict[str, list[int]] = {}
    for host, _, rank, _ in readers:
        hosts.setdefault(host, []).append(rank)
    for host, ranks in hosts.items():
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise ValueError(
                f"data readers on host {host} have data-parallel ranks {ranks}; "
                "mosaicml-streaming needs each host's readers to be consecutive"
            )
    if len({len(ranks) for ranks in hosts.values()}) != 1:
        raise ValueError(
            "hosts have different numbers of data readers "
            f"{ {h: len(r) for h, r in hosts.items()} }; mosaicml-streaming needs "
            "the same number on every host"
        )
    readers_group = None
    if len(readers) != dist.get_world_size():  # every rank, so that all count groups alike
        readers_group = dist.new_group([e[3] for e in readers])
    if not is_reader:
        return None
    local = hosts[socket.gethostname()]
    return StreamingWorld(dp_rank, dp_size, local.index(dp_rank), len(local), readers_group)


class _StoppableLoader(StreamingDataLoader):
    """Keeps the torch iterator it hands out, so that its worker processes can be shut down
    while an exception's traceback still holds the iterator (dropping the last reference is
    torch's only public way). Both hooks are torch's private names; the test of
    ``TokenBatches.close`` fails if an upgrade renames them."""

    _live: Any = None  # torch's live iterator: a _MultiProcessingDataLoaderIter with workers

    def _get_iterator(self):
        self._live = super()._get_iterator()
        return self._live

    def stop_workers(self) -> None:
        live, self._live = self._live, None
        if live is not None and live._num_workers:
            live._shutdown_workers()


class TokenBatches:
    """Micro-batches ``{"tokens", "labels", "sample_ids"}`` of one split, for one data-parallel
    replica: ``tokens``/``labels`` are int64 ``[micro_batch_size, seq_length]``, ``labels`` the
    tokens shifted by one, and ``sample_ids`` (int64 ``[micro_batch_size]``) name the samples.

    ``path`` is a prepared dataset directory, or several ``DataStream``s to mix. ``remote``
    (an object-store URL of a prepared dataset) streams shards into ``path``, which then acts
    as the local cache. By default it never ends (a new epoch follows each one) and drops the
    last partial batch, so every batch has the same shape; ``state_dict()`` /
    ``load_state_dict()`` resume exactly. ``finite=True`` yields one pass (last batch possibly
    smaller) per ``for`` loop, for validation.

    The sample order depends on the datasets, ``seed`` and ``num_canonical_nodes`` only, not
    on the number of readers: sample ids follow one global sequence, of which each step's
    micro-batches over all readers take the next ``micro_batch_size * readers * micro-batches``
    (reader ``r`` of ``R`` on one host takes every ``R``-th). ``step_samples`` (the global
    batch of a training step) cuts every epoch to whole steps, so no step spans two epochs and
    each step takes the same samples under any layout (readers, nodes, micro-batch size) with
    that step size: a run resumed at another data-parallel size continues the sequence of the
    uninterrupted run exactly. ``num_canonical_nodes`` and the readers' node count must divide
    one another (the default 1 fits any); a resumed run keeps the value and seed of its state.
    A resume that cannot continue the sequence exactly is refused, naming both layouts.
    """

    def __init__(
        self,
        path: str | Path | Sequence[DataStream],
        split: str,
        micro_batch_size: int,
        seq_length: int,
        world: StreamingWorld,
        seed: int,
        shuffle: bool = True,
        remote: Optional[str] = None,
        num_workers: int = 0,
        finite: bool = False,
        num_canonical_nodes: int = 1,
        step_samples: Optional[int] = None,
    ):
        if isinstance(path, (str, Path)):
            sources = [DataStream(path, remote)]
        elif remote is not None:
            raise ValueError("remote: give each DataStream its own remote when mixing datasets")
        else:
            sources = list(path)
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size}: must be >= 1")
        if num_canonical_nodes < 1:
            raise ValueError(f"num_canonical_nodes={num_canonical_nodes}: must be >= 1")
        per_load = micro_batch_size * world.world_size  # samples of one batch on every reader
        if step_samples is not None and (step_samples < 1 or step_samples % per_load):
            raise ValueError(
                f"step_samples={step_samples}: must be a multiple of micro_batch_size"
                f" * readers = {per_load}"
            )
        self.where = " + ".join(f"{stream.path}/{split}" for stream in sources)
        self.micro_batch_size, self.seq_length = micro_batch_size, seq_length
        self.world, self.finite, self.step_samples = world, finite, step_samples
        self.canonical_nodes = num_canonical_nodes  # a loaded state's value replaces it
        self._nodes_checked = False  # at the first batch, or when a state is loaded
        streams = split_streams(sources, split, seq_length)
        with streaming_env(world):
            if world.local_rank == 0:
                _clean_stale_files()
            if dist.is_initialized():  # every reader picks its prefix after the cleaning
                dist.barrier()
            with prefix_probes_closed_when_dropped(), prefix_chosen_by_the_leader(world.group):
                self.dataset = _NumberedDataset(
                    streams=streams,
                    shuffle=shuffle,
                    shuffle_seed=seed,
                    num_canonical_nodes=num_canonical_nodes,
                    batch_size=micro_batch_size,
                )
            self.loader = _StoppableLoader(
                self.dataset,
                batch_size=micro_batch_size,
                num_workers=num_workers,
                drop_last=not finite,
                collate_fn=_collate,
            )
        self._batches: Optional[Iterator[dict]] = None  # the current pass (epoch)
        self._left: Optional[int] = None  # batches this reader still takes from the pass
        self._epoch_samples = self.dataset.epoch_size  # what one step-cut epoch uses
        if step_samples is not None:
            self._epoch_samples -= self._epoch_samples % step_samples
            if not self._epoch_samples:
                raise DataError(
                    f"{self.where}: {self.dataset.epoch_size} samples give no full "
                    f"training step of {step_samples} samples (the global batch); "
                    "lower the batch size or add data"
                )

    def __iter__(self) -> "TokenBatches":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        with streaming_env(self.world):
            if not self._nodes_checked:
                check_node_count(self.canonical_nodes, self._layout(), None)
                self._nodes_checked = True
            # At most: the current pass ends (or its whole steps do), a pass resumed at its
            # end is empty or ends at once, and a fresh pass must then yield, unless the split
            # is too small for one micro-batch.
            for _ in range(4):
                if self._batches is None:
                    self._batches, self._left = iter(self.loader), None
                batch = self._next_batch() if self._left != 0 else None
                if batch is not None:
                    self._left = self._batches_left() if self._left is None else self._left - 1
                    if self._left >= 0:
                        return self._shift(batch)
                self._batches = None  # the pass ended, or its last whole step did
                if self.finite:
                    raise StopIteration
        raise DataError(
            f"{self.where}: {self.dataset.epoch_size} samples give no full "
            f"micro-batch of {self.micro_batch_size} per data-parallel reader ("
            f"{self.world.world_size} readers); lower the micro-batch size or add data"
        )

    def close(self) -> None:
        """Stop this stream's DataLoader workers and reading threads now, and release its
        shared memory. Forked inside the trainer's stop guard, the workers hold its stop
        signals blocked (``t2train/signals.py``), so the interpreter's exit, which terminates
        and then joins them, would wait forever; torch's own shutdown asks them to finish
        through their index queues instead. streaming would keep the shared memory until the
        process exits (``release_shared_memory``)."""
        self._batches = None
        self.loader.stop_workers()
        iterating = getattr(self.dataset, "_iterator", None)
        if iterating is not None:  # this process's own reads (no DataLoader workers)
            iterating.exit()
        release_shared_memory(self.dataset)

    def state_dict(self) -> dict:
        """The position in the stream (global: the same on every reader) and the layout that
        saved it. At the end of an epoch's whole steps it is the start of the next epoch."""
        with streaming_env(self.world):
            state = cast(dict, self.loader.state_dict())
        if self.step_samples is not None and state["sample_in_epoch"] >= self._epoch_samples:
            state.update(epoch=state["epoch"] + 1, sample_in_epoch=0)
        return dict(state, layout=self._layout())

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` with the next batch (streaming applies it at the next pass);
        ``DataError`` if this layout cannot continue its sample sequence exactly."""
        state = dict(state)
        saved = state.pop("layout", None)
        saved = saved or {}  # {}: a state saved without its layout
        if self.step_samples is not None and saved.get("step_samples") not in (
            None,
            self.step_samples,
        ):
            raise DataError(
                f"the data position was saved by a run of {_describe(saved)}; this run has "
                f"{_describe(self._layout())}: the sample sequence continues exactly only with "
                "the same number of samples per step (the global batch size)"
            )
        self.canonical_nodes = state["num_canonical_nodes"]
        check_node_count(self.canonical_nodes, self._layout(), saved)
        self._nodes_checked = True
        with streaming_env(self.world):
            self.loader.load_state_dict(state)
        self._batches = None

    def _next_batch(self) -> Optional[dict]:
        """The pass's next batch, or None at its end; a ``DataError`` raised in a DataLoader
        worker is re-raised as the worker's one-line message."""
        try:
            return next(self._batches, None) if self._batches is not None else None
        except DataError as err:  # from a DataLoader worker: the traceback in the text
            lines = str(err).strip().splitlines()
            if len(lines) > 1:
                raise DataError(lines[-1].split("DataError: ", 1)[-1]) from None
            raise
        except RuntimeError:  # "Background thread failed": the shard it names instead
            failure = getattr(self.dataset, "_shard_failure", None)
            if failure is None:
                raise
            raise failure from None

    def _batches_left(self) -> int:
        """After a pass's first batch: how many more this reader takes before the epoch's
        whole steps are used up (negative: the pass resumed beyond them)."""
        if self.step_samples is None:
            return sys.maxsize
        with streaming_env(self.world):
            position = cast(dict, self.loader.state_dict())["sample_in_epoch"]  # after it
        return (self._epoch_samples - position) // (self.micro_batch_size * self.world.world_size)

    def _layout(self) -> dict:
        nodes = self.world.world_size // self.world.local_world_size
        return {
            "readers": self.world.world_size,
            "nodes": nodes,
            "micro_batch_size": self.micro_batch_size,
            "step_samples": self.step_samples,
        }

    def _shift(self, batch: dict) -> dict[str, torch.Tensor]:
        samples = batch["tokens"].to(torch.int64)  # stored as uint16/uint32
        return {
            "tokens": samples[:, : self.seq_length].contiguous(),
            "labels": samples[:, 1 : self.seq_length + 1].contiguous(),
            "sample_ids": batch["sample_ids"],
        }


def check_node_count(canonical_nodes: int, layout: dict, saved: Optional[dict]) -> None:
    """Refuse a node count at which streaming would not keep the sample order: the canonical
    node count (a saved position's, or the configured one) and the readers' node count must
    divide one another (otherwise streaming reorders samples within steps, or refuses).
    ``layout`` is this run's (``TokenBatches``), ``saved`` that of a loaded position."""
    nodes = layout["nodes"]
    if canonical_nodes % nodes == 0 or nodes % canonical_nodes == 0:
        return
    resumed = saved is not None
    raise DataError(
        f"num_canonical_nodes={canonical_nodes}{' (from the saved data position)' * resumed} "
        f"and this run's data readers on {nodes} nodes ({_describe(layout)}): one must divide "
        "the other to keep the sample order"
        + (f"; the position was saved by a run of {_describe(saved or {})}" if resumed else "")
    )


class _NumberedDataset(ResumeFromObject):
    """A ``StreamingDataset`` whose samples carry their ``sample_id``: the sample's index in
    the loader's datasets (stream after stream, each in stored order), so a test or tool can
    name exactly which samples a reader saw, across resumption and reader counts. A loaded
    position is kept on the dataset (``ResumeFromObject``).

    A shard's files are checked against the hashes the index records (``data prepare`` writes
    them) when this process first reads from it, before any of its samples is returned; a
    shard that cannot be prepared or read raises ``DataError`` naming its file, also when the
    failure happens in streaming's background download thread.
    """

    def get_item(self, sample_id: int, retry: int = 7) -> dict:
        failure = getattr(self, "_shard_failure", None)
        if failure is not None:
            raise failure
        shard_id, _ = self.spanner[sample_id]
        try:
            sample = super().get_item(sample_id, retry)
        except DataError:
            raise
        except Exception as err:  # a shard streaming cannot read: IndexError, RuntimeError...
            self._stop_threads()
            raise getattr(self, "_shard_failure", None) or _shard_error(
                self.shards[shard_id], "cannot read it", err
            ) from None
        verified = self.__dict__.setdefault("_verified_shards", set())
        if shard_id not in verified:
            try:
                _verify_hashes(self.shards[shard_id])
            except DataError:
                self._stop_threads()
                raise
            verified.add(shard_id)
        return dict(sample, sample_id=sample_id)

    def __iter__(self) -> Iterator[dict]:
        yield from super().__iter__()
        failure = getattr(self, "_shard_failure", None)
        if failure is not None:  # streaming ends the pass quietly when a thread failed
            raise failure

    def _prepare_thread(self, it) -> None:
        _exits_counted(super()._prepare_thread, it)

    def _ready_thread(self, it) -> None:
        _exits_counted(super()._ready_thread, it)

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        try:
            super().prepare_shard(shard_id, blocking)
        except Exception as err:  # zstd errors, streaming's "Checksum failure", no remote...
            self._release_shard(shard_id)
            if isinstance(err, DataError):
                raise
            raise _shard_error(self.shards[shard_id], "cannot prepare it", err) from None

    def _release_shard(self, shard_id: int) -> None:
        """After a failed preparation: mark the shard as local, so that the processes waiting
        for it (other DataLoader workers, other readers on this host) stop waiting, read it,
        and meet the failure themselves (streaming prepares a shard again when its file is
        missing) instead of waiting forever for a shard left "preparing"."""

        with self._cache_filelock:
            self._shard_states[shard_id] = _ShardState.LOCAL

    def _stop_threads(self) -> None:
        if hasattr(self, "_event"):  # streaming's download threads end at their next check
            self._event.set()

    def on_exception(self, future) -> None:
        """streaming's background thread failed: keep a ``DataError`` for the reader to raise
        (instead of a thread traceback and "Background thread failed")."""
        error = future.exception()
        if isinstance(error, DataError):
            self._shard_failure = error
            self._event.set()
            return
        super().on_exception(future)


def _exits_counted(thread_body, it) -> None:
    """Run a streaming download thread's body so that it counts as exited also when it
    fails: the pass's end waits for every thread's exit, and streaming counts only normal
    ones, so one failed shard would otherwise leave the reader waiting forever."""
    try:
        thread_body(it)
    except BaseException:
        it.on_exit()
        raise


def _describe(layout: dict) -> str:
    """A saved or current reader layout in words, for errors."""
    if not layout:
        return "an unrecorded layout"
    step = layout.get("step_samples")
    return (
        f"{layout['readers']} data-parallel reader(s) on {layout['nodes']} node(s), "
        f"micro-batch {layout['micro_batch_size']}" + (f", {step} samples per step" if step else "")
    )


def _shard_files(shard) -> list[tuple[str, Any]]:
    """(path, FileInfo) of a shard's files: the raw (extracted) ones and the compressed ones."""
    files = []
    for raw, zipped in shard.file_pairs:
        for info in (raw, zipped):
            if info is not None:
                files.append((os.path.join(shard.dirname, shard.split, info.basename), info))
    return files


def _shard_error(shard, what: str, err: Exception) -> DataError:
    names = " / ".join(path for path, _ in _shard_files(shard))
    cause = str(err).strip().splitlines()
    return DataError(
        f"shard file {names}: {what} ({type(err).__name__}: "
        f"{cause[-1] if cause else ''}); the file is missing or corrupt: prepare "
        "the dataset again (or delete it from a remote dataset's cache)"
    )


def _verify_hashes(shard) -> None:
    """Check the shard's present files against the hashes the index records."""

    for path, info in _shard_files(shard):
        algorithms = sorted(algo for algo in (info.hashes or {}) if is_hash(algo))
        if not algorithms or not os.path.isfile(path):
            continue
        with open(path, "rb") as file:
            digest = get_hash(algorithms[0], file.read())
        if digest != info.hashes[algorithms[0]]:
            raise DataError(
                f"shard file {path}: its {algorithms[0]} hash {digest} differs from "
                f"the index's {info.hashes[algorithms[0]]} (corrupt); prepare the "
                "dataset again (or delete the file: an extracted .mds is extracted "
                "again, a remote dataset's file downloaded again)"
            )


def _collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """One ``[batch, sample_length]`` tensor (a writable copy of streaming's read-only arrays)
    and the samples' ids."""
    return {
        "tokens": torch.from_numpy(np.stack([sample["tokens"] for sample in samples])),
        "sample_ids": torch.tensor([sample["sample_id"] for sample in samples], dtype=torch.int64),
    }


def _clean_stale_files() -> None:
    """Remove what killed runs left on this host, once per process, before its first dataset
    (``shm.py``; live datasets of this and other jobs are never touched)."""
    global _host_cleaned
    if not _host_cleaned:
        clean_stale_streaming_files()
        _host_cleaned = True
