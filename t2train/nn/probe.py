"""Values the model reports while a diagnostics pass records them.

Model code calls ``record(kind, key, compute)`` where an internal value is worth seeing (a
DDL gate, depth-attention weights). Outside ``recording()`` it returns at once and
``compute`` never runs, so the training math and its cost are unchanged. Inside, ``compute``
runs without autograd and the first value per (kind, key) is kept: a later micro-batch or an
activation recompute does not replace it. ``t2train/monitor/diagnostics.py`` turns the
records into TensorBoard summaries.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Hashable, Iterator, Optional

import torch
from torch import Tensor

Records = dict[str, dict[Hashable, Tensor]]  # kind -> key -> value (fp32, on the CPU)

_records: Optional[Records] = None


@contextmanager
def recording() -> Iterator[Records]:
    global _records
    _records = {}
    try:
        yield _records
    finally:
        _records = None


def record(kind: str, key: Hashable, compute: Callable[[], Tensor]) -> None:
    if _records is not None:
        _keep(kind, key, compute)


@torch.compiler.disable  # in a compiled layer (model.fusions): eager, outside the graph
def _keep(kind: str, key: Hashable, compute: Callable[[], Tensor]) -> None:
    if _records is None or key in _records.get(kind, {}):
        return
    with torch.no_grad():
        _records.setdefault(kind, {})[key] = compute().detach().float().cpu()
