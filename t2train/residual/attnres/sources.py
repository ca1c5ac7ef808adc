"""The AttnRes sources of earlier layers as one growing stack, so that every layer compiles
to the same graph.

A read mixes every source so far. As a Python list the sources grew with each block, and
``torch.compile`` specialises on a list's length: one graph per layer. Here a chunk's
sources live in rows of one preallocated buffer [capacity, s, b, h], and a layer reads
``buffer[:n]``, a tensor whose leading size is dynamic to the compiler. The sources a layer
makes are plain tensors inside the layer; ``extend`` copies them into the next rows after
the layer, outside compiled code, and returns the longer view.

Rows are written once, before any read sees them, and never change afterwards, so the
views the reads keep for their backward (no copies) stay valid. The write goes through
``.data``: autograd would otherwise see an in-place change of a tensor those reads saved.
Gradients do not need the buffer: ``extend``'s backward hands each new row's gradient to
the tensor copied into it and the rest to the previous view, so every source's producer
gets what each read returned for it.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._dynamo.decorators import mark_unbacked


class _Extend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer: Tensor, earlier: Tensor, *new: Tensor) -> Tensor:
        n = earlier.shape[0]
        ctx.n = n
        with torch.no_grad():
            for row, source in enumerate(new, start=n):
                buffer.data[row].copy_(source)
        return buffer[: n + len(new)]

    @staticmethod
    def backward(ctx, grad: Tensor):
        return None, grad[: ctx.n], *grad[ctx.n :].unbind(0)


def start(sources: list[Tensor], capacity: int) -> tuple[Tensor, Tensor]:
    """A buffer for ``capacity`` sources (each shaped like ``sources[0]``) and the view of its
    rows holding ``sources``."""
    buffer = sources[0].new_empty(capacity, *sources[0].shape)
    return buffer, extend(buffer, buffer[:0], tuple(sources))


def extend(buffer: Tensor, earlier: Tensor, new: tuple[Tensor, ...]) -> Tensor:
    """``earlier`` (``buffer[:n]``) and the ``new`` sources, as the view ``buffer[:n + k]``."""
    if not new:
        return earlier
    if earlier.shape[0] + len(new) > buffer.shape[0]:
        raise RuntimeError(
            f"AttnRes source buffer holds {buffer.shape[0]} sources, "
            f"{earlier.shape[0] + len(new)} needed"
        )
    return _dynamic_rows(_Extend.apply(buffer, earlier, *new))


def _dynamic_rows(view: Tensor) -> Tensor:
    """Compiled for any number of rows from the first layer on: as a plain (backed) size,
    dynamo would specialise on 1 (the first layers hold the embedding alone), then compile
    once more with the size dynamic."""
    mark_unbacked(view, 0)
    return view
