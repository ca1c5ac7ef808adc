"""Which rank is slow: each rank's own forward time and data wait, compared at log steps.

In synchronous training the slowest rank sets every rank's step time, and the step time
cannot say which rank that is: the others wait for it in the gradient all-reduce. So each
rank times what it does alone, as megatron-core's StragglerDetector does: the forward pass of
each training micro-batch (``ForwardClock``) and the wait for its batch (the step meter's).
At each log step the ranks gather these times (one small all-gather), and each rank is
compared with the other ranks of its pipeline stage, which do the same work (a last stage
also computes the loss, a first the embedding). megatron-core's detector needs CUDA, compares
ranks of different stages and listens on a control port on rank 0; this one runs wherever the
trainer runs and is tested on the CPU.
"""

from __future__ import annotations

import socket
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from t2train.parallel.init import current_device


class ForwardClock:
    """The time this rank spends in forward passes of training micro-batches. Per pass, the
    larger of the host's time and, on a GPU, the device's (CUDA events, read at the next log
    step, where the host waits for the device anyway): a rank whose host cannot launch its
    kernels fast enough is as slow as one whose device is."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event, float]] = []

    @contextmanager
    def timing(self) -> Iterator[None]:
        events = None
        if torch.cuda.is_available():
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        started = time.perf_counter()
        yield
        host = time.perf_counter() - started
        if events is None:
            self._seconds += host
        else:
            events[1].record()
            self._events.append((*events, host))

    def take(self) -> float:
        """Seconds timed since the last ``take`` (on a GPU, waits for the last pass)."""
        seconds, self._seconds = self._seconds, 0.0
        if self._events:
            self._events[-1][1].synchronize()
            seconds += sum(max(s.elapsed_time(e) / 1e3, host) for s, e, host in self._events)
            self._events.clear()
        return seconds


@dataclass(frozen=True)
class RankTimes:
    """One rank's mean times per training step over a log interval."""

    rank: int
    host: str
    stage: int  # pipeline stage
    forward_ms: float
    data_wait_ms: float


@dataclass(frozen=True)
class SlowRank:
    """The rank whose forward time is the largest multiple of its stage's other ranks'."""

    times: RankTimes
    peers: int  # the other ranks of its stage
    peers_ms: float  # their median forward time per step

    @property
    def ratio(self) -> float:
        return self.times.forward_ms / max(self.peers_ms, 1e-9)


def slowest_rank(times: list[RankTimes]) -> Optional[SlowRank]:
    """Within each pipeline stage of two ranks or more, its slowest rank against the median
    of the others; of these, the one furthest above its peers. None without such a stage."""
    stages: dict[int, list[RankTimes]] = {}
    for rank in times:
        stages.setdefault(rank.stage, []).append(rank)
    candidates = []
    for ranks in stages.values():
        if len(ranks) < 2:
            continue
        slowest = max(ranks, key=lambda rank: rank.forward_ms)
        others = [rank.forward_ms for rank in ranks if rank is not slowest]
        candidates.append(SlowRank(slowest, len(others), statistics.median(others)))
    return max(candidates, key=lambda slow: slow.ratio, default=None)


def straggler_scalars(times: list[RankTimes]) -> dict[str, float]:
    """The ``stragglers/*`` tags (docs/monitoring.md) of one log interval."""
    waiting = max(times, key=lambda rank: rank.data_wait_ms)
    values = {
        "stragglers/data_wait_ms_max": waiting.data_wait_ms,
        "stragglers/data_wait_rank": waiting.rank,
    }
    slow = slowest_rank(times)
    if slow is not None:
        values.update(
            {
                "stragglers/forward_ratio": slow.ratio,
                "stragglers/forward_rank": slow.times.rank,
                "stragglers/forward_ms_slowest": slow.times.forward_ms,
                "stragglers/forward_ms_peers": slow.peers_ms,
            }
        )
    return values


def straggler_warning(times: list[RankTimes], factor: float) -> Optional[str]:
    """One console line naming the slowest rank when its forward time is ``factor`` times
    its peers' or more (0: never)."""
    slow = slowest_rank(times)
    if not factor or slow is None or slow.ratio < factor:
        return None
    rank = slow.times
    return (
        f"slow rank: rank {rank.rank} (host {rank.host}, pipeline stage {rank.stage}) spent "
        f"{rank.forward_ms:.1f} ms per step in forward passes, {slow.ratio:.2f}x the median of "
        f"the other {slow.peers} rank(s) of its stage ({slow.peers_ms:.1f} ms; "
        f"log.straggler_factor={factor:g}); it waited {rank.data_wait_ms:.1f} ms per step "
        "for data"
    )


class StragglerMeter:
    """Gathers every rank's times at log steps (every rank calls ``gather`` at the same
    steps). Construction is collective too: it gathers the ranks' host names."""

    def __init__(self, stage: int):
        self.stage = stage
        self.intervals = 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.hosts = [socket.gethostname()] * self.world
        if self.world > 1:
            dist.all_gather_object(self.hosts, socket.gethostname())

    def gather(self, forward_s: float, data_wait_s: float, steps: int) -> list[RankTimes]:
        """Every rank's mean times per step over the last ``steps`` steps; empty for a world
        of one rank, and for a process's first interval (compilation and warm-up, which ranks
        go through at different speeds)."""
        self.intervals += 1
        if self.world == 1 or self.intervals == 1:
            return []
        mine = torch.tensor(
            [self.stage, forward_s * 1e3 / steps, data_wait_s * 1e3 / steps],
            dtype=torch.float64,
            device=current_device(),
        )
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine)
        rows = torch.stack(everyone).tolist()
        return [
            RankTimes(rank, self.hosts[rank], int(stage), forward_ms, data_wait_ms)
            for rank, (stage, forward_ms, data_wait_ms) in enumerate(rows)
        ]
