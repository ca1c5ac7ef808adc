"""HC's kernels at a preset's shapes, n = ``model.hc.expansion_rate`` streams: the read and
the write with the weights as given (fp32, as the model computes them), and the backward of
a write and the next read (compiled code's dynamic connections)."""

from __future__ import annotations

from typing import Iterator

import torch

from t2train.kernels.benchmark import Case, KernelShapes, Runtime, peers
from t2train.residual.hc.compiled import HC_CONNECT_BACKWARD, Read, Write
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


def _flat_gradients(gradients: tuple) -> list:
    """(the state's, the write's, the read's) -> one list of tensors."""
    state, write, read = gradients
    return [state, *write, *read]


def connect_backward_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    """The backward alone (its one mode, ``fwd``, is the call): the gradients of the new
    streams, of the normed input and of the handed-on logits in; bytes: the state, the
    output and their gradients, the new streams' gradient and the normed input's, each once
    (3n + 3 units)."""
    n, tokens, hidden = shapes.model.hc.expansion_rate, (shapes.seq, shapes.batch), shapes.hidden
    m = n + 2
    wide, narrow = backward_inputs(rt)
    logits, static = narrow(n, *tokens, m), (narrow(n, n + 1), narrow(n))
    write = Write(wide(*tokens, hidden), logits, *static, narrow(1), narrow(1))
    read = Read(narrow(m, hidden), narrow(n, n + 1), narrow(1), (1 + narrow(hidden)).to(rt.dtype))
    per_token = (narrow(n, *tokens, m), narrow(n, *tokens, 1).abs() + 0.5)
    yield backward_case(shapes, rt, HC_CONNECT_BACKWARD, n, (write, read, per_token), 3 * n + 3)


def backward_inputs(rt: Runtime) -> tuple:
    """Makers of a backward's inputs: wide ones in the run's dtype, narrow ones fp32."""
    wide = lambda *shape: torch.randn(*shape, device=rt.device, dtype=rt.dtype)  # noqa: E731
    narrow = lambda *shape: torch.randn(*shape, device=rt.device) * 0.5  # noqa: E731
    return wide, narrow


def backward_case(shapes: KernelShapes, rt: Runtime, kernel, n: int, parts, units: int) -> Case:
    """A connect's backward (``kernel``) over n streams timed alone, given ``parts``: its
    write and its read, and the per-token numbers the read handed on and kept; the states and
    the gradients random. Bytes: ``units`` [tokens, h] tensors."""
    write, read, per_token = parts
    tokens, hidden = (shapes.seq, shapes.batch), shapes.hidden
    wide, narrow = backward_inputs(rt)
    state, streams, grad_streams = (wide(n, *tokens, hidden) for _ in range(3))
    grads = (grad_streams, wide(*tokens, hidden), narrow(*per_token[0].shape))
    arguments = (state, write, read, 1e-5, streams, *per_token, *grads)
    return Case(
        kernel.name,
        shapes.label,
        f"s={shapes.seq} b={shapes.batch} h={hidden} n={n} (backward)",
        peers(rt, kernel, lambda f: _flat_gradients(f(*arguments)), []),
        {"fwd": units * write.out.numel() * write.out.element_size()},
        "GB/s",
    )


# benchmark (``--only``) -> its cases, and the kernels of the table they time
BENCHMARKS = {
    "hc_stream": (stream_cases, ("hc_read", "hc_write")),
    "hc_connect_backward": (connect_backward_cases, ("hc_connect_backward",)),
}
