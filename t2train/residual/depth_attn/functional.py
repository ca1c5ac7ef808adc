"""The math of `depth_attn` (a causal attention read over a token's last K layer states,
arXiv 2603.16039), written once for the trainer and the exported modeling file (a
``functional`` module: torch only). The token dims ``...`` are [s, b] in training, [b, s] in
the export.
"""

from __future__ import annotations

from torch import Tensor


def depth_heads(q: Tensor, kv: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """The read's one query per token and its keys and values over the window, per head:
    q [T, heads, 1, d] and k, v [T, heads, n, d] (T the tokens) from q [..., heads d] and
    kv [..., n, 2 heads d], which holds each head's key rows then its value rows."""
    n, d = kv.shape[-2], q.shape[-1] // heads
    k, v = kv.reshape(-1, n, heads, 2, d).permute(3, 0, 2, 1, 4)
    return q.reshape(-1, heads, 1, d), k, v


def slide(window: list[Tensor], size: int) -> tuple:
    """The states a later layer's window still holds: the last ``size - 1`` of ``window``
    (the states entering this layer and the ones before it)."""
    keep = size - 1
    return tuple(window[-keep:]) if keep else ()
