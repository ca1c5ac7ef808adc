"""DDL's kernels at a preset's shapes, for a vector state (d_v = 1, the default) and the
paper's matrix state (d_v = 4): the delta write and the gate logits in fp32.

Bytes are the tensors a fused pass must read and write once: the write reads the state and
k~ and writes the new state (its backward: state, k~, incoming and outgoing gradients)."""

from __future__ import annotations

from typing import Iterator

from t2train.kernels.benchmark import Case, KernelShapes, Runtime, peers
from t2train.nn.precision import FP32_LINEAR
from t2train.residual.ddl.layers import DELTA_WRITE

STATE_WIDTHS = (1, 4)  # d_v


def delta_write_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    """The write over one micro-batch of the preset's width, for each d_v."""
    tokens, hidden = (shapes.seq, shapes.batch), shapes.hidden
    k_eps, v_scale = shapes.model.ddl.k_eps, shapes.model.ddl.v_scale
    for dv in STATE_WIDTHS:
        state = rt.leaf(*tokens, hidden) if dv == 1 else rt.leaf(dv, *tokens, hidden)
        out, beta, v = rt.leaf(*tokens, hidden), rt.leaf(*tokens, 1), rt.leaf(*tokens, dv)
        inputs = [state, out, beta, v]
        unit = state.element_size() * out.numel()
        yield Case(
            "delta_write",
            shapes.label,
            f"s={tokens[0]} b={tokens[1]} h={hidden} d_v={dv}",
            peers(rt, DELTA_WRITE, lambda f, args=tuple(inputs): f(*args, k_eps, v_scale), inputs),
            {"fwd": (2 * dv + 1) * unit, "fwd+bwd": (5 * dv + 3) * unit},
            "GB/s",
        )


def gate_logit_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    """The gate logits in fp32 (beta: one output; v: d_v outputs) over one micro-batch."""
    tokens, hidden = (shapes.seq, shapes.batch), shapes.hidden
    x = rt.leaf(*tokens, hidden)
    for outputs in STATE_WIDTHS:
        weight, bias = rt.leaf(outputs, hidden, scale=hidden**-0.5), rt.leaf(outputs)
        inputs = [x, weight, bias]
        unit = x.numel() * x.element_size()  # read x; the backward reads x, writes dx
        yield Case(
            "fp32_linear",
            shapes.label,
            f"s={tokens[0]} b={tokens[1]} h={hidden} outputs={outputs}",
            peers(rt, FP32_LINEAR, lambda f, args=tuple(inputs): f(*args), inputs),
            {"fwd": unit, "fwd+bwd": 3 * unit},
            "GB/s",
        )


# benchmark (``--only``) -> its cases, and the kernels of the table they time
BENCHMARKS = {
    "delta_write": (delta_write_cases, ("delta_write",)),
    "fp32_linear": (gate_logit_cases, ("fp32_linear",)),
}
