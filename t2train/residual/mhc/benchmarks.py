"""mHC's kernels at a preset's shapes: the stream read and write (Sinkhorn with
``model.mhc.sinkhorn_iterations``, n = ``model.mhc.expansion_rate`` streams: the paper's
defaults 20 and 4) over one micro-batch, and compiled code's: the write's mappings alone,
and the backward of a write and the next read; the mixing logits are fp32, as the model
computes them."""

from __future__ import annotations

from typing import Iterator

import torch

from t2train.kernels.benchmark import Case, KernelShapes, Runtime, peers
from t2train.residual.hc.benchmarks import backward_case, backward_inputs, read_and_write
from t2train.residual.mhc.compiled import MHC_CONNECT_BACKWARD, Read, Write
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


def connect_backward_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    """The backward alone (its one mode, ``fwd``, is the call): the gradients of the new
    streams, of the normed input and of the handed-on projection in; bytes: the state, the
    output and their gradients, the new streams' gradient and the normed input's, each once,
    and dphi's read of the new streams (4n + 3 units)."""
    n, tokens, hidden = shapes.model.mhc.expansion_rate, (shapes.seq, shapes.batch), shapes.hidden
    m = n * n + 2 * n
    wide, narrow = backward_inputs(rt)
    mixing = torch.softmax(narrow(*tokens, n, n), -1)
    write = Write(wide(*tokens, hidden), mixing, 1 + narrow(*tokens, n))
    norm_weight = (1 + narrow(hidden)).to(rt.dtype)
    read = Read(narrow(m, n * hidden) / hidden**0.5, 1 + narrow(1), narrow(n), norm_weight)
    per_token = (narrow(*tokens, m), narrow(*tokens, 1).abs() + 0.5)
    yield backward_case(shapes, rt, MHC_CONNECT_BACKWARD, n, (write, read, per_token), 4 * n + 3)


# benchmark (``--only``) -> its cases, and the kernels of the table they time
BENCHMARKS = {
    "stream_mix": (stream_cases, ("stream_read", "stream_write")),
    "mhc_write_mappings": (mapping_cases, ("mhc_write_mappings",)),
    "mhc_connect_backward": (connect_backward_cases, ("mhc_connect_backward",)),
}
