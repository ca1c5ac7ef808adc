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
    unit = out.numel() * out.element_size()
    shape = f"s={tokens[0]} b={tokens[1]} h={hidden} n={n}"
    yield Case(
        "hc_read",
        shapes.label,
        shape,
        peers(
            rt,
            HC_READ.triton_function(),
            HC_READ.reference,
            lambda f: f(state, read),
            [state, read],
        ),
        {"fwd": (n + 1) * unit, "fwd+bwd": (3 * n + 2) * unit},
        "GB/s",
    )
    write = [state, residual, beta, out]
    yield Case(
        "hc_write",
        shapes.label,
        shape,
        peers(rt, HC_WRITE.triton_function(), HC_WRITE.reference, lambda f: f(*write), write),
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
        peers(
            rt,
            RMS_FP32_LINEAR.triton_function(),
            RMS_FP32_LINEAR.reference,
            lambda f: f(state, weight, None, eps),
            [state, weight],
        ),
        {"fwd": unit, "fwd+bwd": 3 * unit},
        "GB/s",
    )


# benchmark (``--only``) -> its cases, and the kernels of the table they time
BENCHMARKS = {
    "hc_stream": (stream_cases, ("hc_read", "hc_write")),
    "rms_fp32_linear": (dynamic_weight_cases, ("rms_fp32_linear",)),
}
