"""mHC's kernels at a preset's shapes: the stream read and write (Sinkhorn with
``model.mhc.sinkhorn_iterations``, n = ``model.mhc.expansion_rate`` streams: the paper's
defaults 20 and 4) over one micro-batch; the mixing logits are fp32, as the model computes
them."""

from __future__ import annotations

from typing import Iterator

import torch

from t2train.kernels.benchmark import Case, KernelShapes, Runtime, peers
from t2train.residual.mhc.layers import STREAM_READ, STREAM_WRITE


def stream_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    options = shapes.model.mhc
    n, iterations = options.expansion_rate, options.sinkhorn_iterations
    tokens, hidden = (shapes.seq, shapes.batch), shapes.hidden
    state, out = rt.leaf(n, *tokens, hidden), rt.leaf(*tokens, hidden)
    pre, post, res = (
        torch.randn(*tokens, *shape, device=rt.device).requires_grad_()
        for shape in ((n,), (n,), (n, n))
    )
    unit = out.numel() * out.element_size()
    read = [state, pre]
    yield Case(
        "stream_read",
        shapes.label,
        f"s={tokens[0]} b={tokens[1]} h={hidden} n={n}",
        peers(rt, STREAM_READ.triton_function(), STREAM_READ.reference, lambda f: f(*read), read),
        {"fwd": (n + 1) * unit, "fwd+bwd": (3 * n + 2) * unit},
        "GB/s",
    )
    write = [state, out, post, res]
    yield Case(
        "stream_write",
        shapes.label,
        f"s={tokens[0]} b={tokens[1]} h={hidden} n={n} iterations={iterations}",
        peers(
            rt,
            STREAM_WRITE.triton_function(),
            STREAM_WRITE.reference,
            lambda f: f(*write, iterations),
            write,
        ),
        {"fwd": (2 * n + 1) * unit, "fwd+bwd": (5 * n + 3) * unit},
        "GB/s",
    )


# benchmark (``--only``) -> its cases, and the kernels of the table they time
BENCHMARKS = {"stream_mix": (stream_cases, ("stream_read", "stream_write"))}
