"""Memory of the training processes: CUDA allocator counters and host resident set size."""

from __future__ import annotations

import psutil
import torch
import torch.distributed as dist

GIB = 2.0**30


def memory_gib() -> dict[str, float]:
    """The largest value over all ranks (collective), in GiB.

    ``memory/rss_gib`` always (host memory of the process); with CUDA also the caching
    allocator's allocated and reserved bytes and the peak allocated since the start.
    """
    names = ["memory/rss_gib"]
    values = [psutil.Process().memory_info().rss]
    if torch.cuda.is_available():
        names += ["memory/allocated_gib", "memory/reserved_gib", "memory/peak_allocated_gib"]
        values += [
            torch.cuda.memory_allocated(),
            torch.cuda.memory_reserved(),
            torch.cuda.max_memory_allocated(),
        ]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    largest = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return {name: float(value) / GIB for name, value in zip(names, largest.tolist())}
