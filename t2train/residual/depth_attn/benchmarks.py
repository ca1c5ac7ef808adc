"""The depth read at a preset's shapes: one query per token and head over its last
``model.depth_attn.window`` layer states (the model's heads, no grouping), against the
FlashAttention-style kernel that served it before the one-query kernels (16 query rows per
tile, 15 of them padding)."""

from __future__ import annotations

from typing import Iterator

from t2train.kernels.benchmark import Case, Impl, KernelShapes, Runtime
from t2train.kernels.window_attention import tiled_window_attention
from t2train.residual.window_attention import WINDOW_ATTENTION


def depth_read_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    window_attention, short_window_attention = (
        WINDOW_ATTENTION.triton_function(),
        WINDOW_ATTENTION.reference,
    )
    tokens, h, d = shapes.batch * shapes.seq, shapes.heads, shapes.head_dim
    n = shapes.model.depth_attn.window
    q, k, v = rt.leaf(tokens, h, 1, d), rt.leaf(tokens, h, n, d), rt.leaf(tokens, h, n, d)
    scale = d**-0.5
    compiled = rt.compile(short_window_attention)
    impls = [
        Impl("triton", lambda: window_attention(q, k, v, n, scale), [q, k, v]),
        Impl(
            "triton, 16-query tiles", lambda: tiled_window_attention(q, k, v, n, scale), [q, k, v]
        ),
        Impl("eager", lambda: short_window_attention(q, k, v, n, scale), [q, k, v]),
        Impl("torch.compile", lambda: compiled(q, k, v, n, scale), [q, k, v]),
    ]
    unit = tokens * h * d * q.element_size()  # q or o; k and v are n of these each
    yield Case(
        "depth_read",
        shapes.label,
        f"tokens={tokens} h={h} n={n} d={d}",
        impls,
        {"fwd": (2 * n + 2) * unit, "fwd+bwd": (6 * n + 5) * unit},
        "GB/s",
    )


# benchmark (``--only``) -> its cases, and the kernels of the table they time
BENCHMARKS = {"depth_read": (depth_read_cases, ("window_attention",))}
