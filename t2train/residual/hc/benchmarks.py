"""HC's kernels at a preset's shapes, n = ``model.hc.expansion_rate`` streams: the read and
the write with the weights as given (fp32, as the model computes them)."""

from __future__ import annotations

from typing import Iterator

import torch

from t2train.kernels.benchmark import Case, KernelShapes, Runtime, peers
from t2train.residual.hc.layers import HC_READ, HC_WRITE


def _fp32_leaf(rt: Runtime, *shape) -> torch.Tensor:
    return torch.randn(*shape, device=rt.device).requires_grad_()


def stream_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    n, tokens, hidden = shapes.model.hc.expansion_rate, (shapes.seq, shapes.batch), shapes.hidden
    state, out = rt.leaf(n, *tokens, hidden), rt.leaf(*tokens, hidden)
    read, beta = _fp32_leaf(rt, *tokens, n), _fp32_leaf(rt, *tokens, n)
    residual = _fp32_leaf(rt, *tokens, n, n)
    yield from read_and_write(
        shapes, rt, (HC_READ, HC_WRITE), [state, read], [state, residual, beta, out]
    )


def read_and_write(shapes, rt, kernels, read: list, write: list, write_extra=(), write_label=""):
    """An n-stream read ([n, s, b, h] in, [s, b, h] out) and write (the stream and the
    sublayer output in, the new stream out), each given its tensors; ``write_extra`` follow
    the write's tensors, ``write_label`` names them in its shape. Bytes: the streams and the
    output, read or written once."""
    state = read[0]
    n, unit = state.shape[0], state[0].numel() * state.element_size()
    shape = f"s={shapes.seq} b={shapes.batch} h={shapes.hidden} n={n}"
    yield Case(
        kernels[0].name,
        shapes.label,
        shape,
        peers(rt, kernels[0], lambda f: f(*read), read),
        {"fwd": (n + 1) * unit, "fwd+bwd": (3 * n + 2) * unit},
        "GB/s",
    )
    yield Case(
        kernels[1].name,
        shapes.label,
        shape + write_label,
        peers(rt, kernels[1], lambda f: f(*write, *write_extra), write),
        {"fwd": (2 * n + 1) * unit, "fwd+bwd": (5 * n + 3) * unit},
        "GB/s",
    )


# benchmark (``--only``) -> its cases, and the kernels of the table they time
BENCHMARKS = {
    "hc_stream": (stream_cases, ("hc_read", "hc_write")),
}
