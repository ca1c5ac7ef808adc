"""mHC's kernels at a preset's shapes: the stream read and write (Sinkhorn with
``model.mhc.sinkhorn_iterations``, n = ``model.mhc.expansion_rate`` streams: the paper's
defaults 20 and 4) over one micro-batch, and the write's mappings alone (compiled code's);
the mixing logits are fp32, as the model computes them."""

from __future__ import annotations

from typing import Iterator

import torch

from t2train.kernels.benchmark import Case, KernelShapes, Runtime, peers
from t2train.residual.hc.benchmarks import read_and_write
from t2train.residual.mhc.layers import STREAM_READ, STREAM_WRITE, WRITE_MAPPINGS


def stream_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    options = shapes.model.mhc
    n, iterations = options.expansion_rate, options.sinkhorn_iterations
    tokens, hidden = (shapes.seq, shapes.batch), shapes.hidden
    state, out = rt.leaf(n, *tokens, hidden), rt.leaf(*tokens, hidden)
    pre, post, res = (
        torch.randn(*tokens, *shape, device=rt.device).requires_grad_()
        for shape in ((n,), (n,), (n, n))
    )
    yield from read_and_write(
        shapes,
        rt,
        (STREAM_READ, STREAM_WRITE),
        [state, pre],
        [state, out, post, res],
        (iterations,),
        f" iterations={iterations}",
    )


def mapping_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    """H_post and H_res from their logits; bytes: the logits in and the mappings out (and
    back: their gradients in, the logits' out), fp32, each once."""
    options = shapes.model.mhc
    n, iterations = options.expansion_rate, options.sinkhorn_iterations
    tokens = (shapes.seq, shapes.batch)
    post = torch.randn(*tokens, n, device=rt.device).requires_grad_()
    res = torch.randn(*tokens, n, n, device=rt.device).requires_grad_()
    once = post.numel() * 4 * (n + 1)  # [..., n] and [..., n, n], fp32
    yield Case(
        WRITE_MAPPINGS.name,
        shapes.label,
        f"s={shapes.seq} b={shapes.batch} n={n} iterations={iterations}",
        peers(rt, WRITE_MAPPINGS, lambda f: list(f(post, res, iterations)), [post, res]),
        {"fwd": 2 * once, "fwd+bwd": 5 * once},
        "GB/s",
    )


# benchmark (``--only``) -> its cases, and the kernels of the table they time
BENCHMARKS = {
    "stream_mix": (stream_cases, ("stream_read", "stream_write")),
    "mhc_write_mappings": (mapping_cases, ("mhc_write_mappings",)),
}
