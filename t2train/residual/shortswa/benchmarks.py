"""The mixer's kernel at a preset's shapes: causal window attention over the sequence, at
``model.shortswa.window`` (the default window when the preset leaves the mixer off), against
FlexAttention's sliding-window block mask and flash-attn's ``window_size`` where installed."""

from __future__ import annotations

import importlib.util
from typing import Iterator

import torch

from t2train.kernels.benchmark import Case, Impl, KernelShapes, Runtime
from t2train.residual.shortswa import ShortSWAOptions
from t2train.residual.window_attention import WINDOW_ATTENTION


def window_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    """One micro-batch of the preset's heads, causal window."""
    window_attention, short_window_attention = (
        WINDOW_ATTENTION.triton_function(),
        WINDOW_ATTENTION.reference,
    )
    b, s, d = shapes.batch, shapes.seq, shapes.head_dim
    w = shapes.model.shortswa.window or ShortSWAOptions.default_window
    h, hk = shapes.heads, shapes.kv_heads
    q, k, v = rt.leaf(b, h, s, d), rt.leaf(b, hk, s, d), rt.leaf(b, hk, s, d)
    compiled = rt.compile(short_window_attention)
    impls = [
        Impl("triton", lambda: window_attention(q, k, v, w), [q, k, v]),
        Impl("eager", lambda: short_window_attention(q, k, v, w), [q, k, v]),
        Impl("torch.compile", lambda: compiled(q, k, v, w), [q, k, v]),
    ]
    impls += _flex_impls(rt, q, k, v, w)
    impls += _flash_impls(rt, b, h, hk, s, d, w)
    pairs = sum(min(w, p + 1) for p in range(s))
    flops = 4 * b * h * d * pairs  # attention forward: 4 d per visited query-key pair
    yield Case(
        "window_attention",
        shapes.label,
        f"b={b} h={h}/{hk} s={s} d={d} w={w}",
        impls,
        {"fwd": flops, "fwd+bwd": 3.5 * flops},
        "TFLOP/s",
    )


def _flex_impls(rt: Runtime, q, k, v, window) -> list[Impl]:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return []

    def band(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    seq = q.shape[-2]
    mask = create_block_mask(band, None, None, seq, seq, device=rt.device)
    # Eager FlexAttention is a slow reference; on CUDA it is only ever used compiled.
    attend = torch.compile(flex_attention) if rt.on_cuda else flex_attention
    gqa = q.shape[1] != k.shape[1]
    return [
        Impl("flex_attention", lambda: attend(q, k, v, block_mask=mask, enable_gqa=gqa), [q, k, v])
    ]


def _flash_impls(rt: Runtime, b, h, hk, s, d, window) -> list[Impl]:
    if not rt.on_cuda or importlib.util.find_spec("flash_attn") is None:
        return []
    from flash_attn import flash_attn_func

    q, k, v = rt.leaf(b, s, h, d), rt.leaf(b, s, hk, d), rt.leaf(b, s, hk, d)
    return [
        Impl(
            "flash_attn",
            lambda: flash_attn_func(q, k, v, causal=True, window_size=(window - 1, 0)),
            [q, k, v],
        )
    ]


# benchmark (``--only``) -> its cases, and the kernels of the table they time
BENCHMARKS = {"window_attention": (window_cases, ("window_attention",))}
