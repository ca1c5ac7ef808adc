"""HC's kernels at a preset's shapes, n = ``model.hc.expansion_rate`` streams: the read and
the write with the weights as given (fp32, as the model computes them), and the dynamic
weights' logits (each stream RMS-normalised on its own, n + 2 logits in fp32, the norm's
weight folded into the fp32 projection as the model does)."""

from __future__ import annotations

from typing import Iterator

import torch

from t2train.kernels.benchmark import Case, KernelShapes, Runtime, peers
from t2train.nn.precision import RMS_FP32_LINEAR
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


def dynamic_weight_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    n, eps = shapes.model.hc.expansion_rate, shapes.model.norm_epsilon
    outputs = n + 2
    state = rt.leaf(n, shapes.seq, shapes.batch, shapes.hidden)
    weight = (
        torch.randn(outputs, shapes.hidden, device=rt.device) * shapes.hidden**-0.5
    ).requires_grad_()
    unit = state.numel() * state.element_size()  # read x; the backward reads x, writes dx
    yield Case(
        "rms_fp32_linear",
        shapes.label,
        f"n={n} s={shapes.seq} b={shapes.batch} h={shapes.hidden} outputs={outputs}",
        peers(rt, RMS_FP32_LINEAR, lambda f: f(state, weight, None, eps), [state, weight]),
        {"fwd": unit, "fwd+bwd": 3 * unit},
        "GB/s",
    )


# benchmark (``--only``) -> its cases, and the kernels of the table they time
BENCHMARKS = {
    "hc_stream": (stream_cases, ("hc_read", "hc_write")),
    "rms_fp32_linear": (dynamic_weight_cases, ("rms_fp32_linear",)),
}
