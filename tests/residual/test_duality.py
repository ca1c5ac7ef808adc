"""The duality as a test: the depth read is short-window attention over the depth axis.

A random stack of residual states H [L+1, T, B, d] with shared W_Q, W_K, W_V. The depth read
is computed by its per-token definition (arXiv 2603.16039 Sec. 2.2, an explicit loop over
tokens and layers) and by ``short_window_attention`` applied once over depth, with depth as
the sequence axis and (T, B) folded into the batch. Outputs and gradients must agree.
"""

import math

import pytest
import torch

from t2train.residual import depth_attn, window_attention
from t2train.residual.window_attention import short_window_attention

L, T, B, D = 5, 3, 2, 8


def depth_read_by_definition(H, W_Q, W_K, W_V, K):
    """z_t^(l) = softmax(q K^T / sqrt(d_k)) V over W_{t,l} = [h_t^(max(0,l-K+1)) .. h_t^(l)]."""
    out = torch.empty(L + 1, T, B, W_V.shape[1], dtype=H.dtype)
    for t in range(T):
        for b in range(B):
            for layer in range(L + 1):
                window = H[max(0, layer - K + 1): layer + 1, t, b]  # [K_l, d], truncated
                q = H[layer, t, b] @ W_Q
                scores = (window @ W_K) @ q / math.sqrt(W_Q.shape[1])
                out[layer, t, b] = torch.softmax(scores, dim=0) @ (window @ W_V)
    return out


def depth_read_as_window_attention(H, W_Q, W_K, W_V, K):
    over_depth = H.permute(1, 2, 0, 3).reshape(T * B, 1, L + 1, D)  # depth is the sequence
    z = short_window_attention(over_depth @ W_Q, over_depth @ W_K, over_depth @ W_V, K,
                               scale=1 / math.sqrt(W_Q.shape[1]))
    return z.reshape(T, B, L + 1, -1).permute(2, 0, 1, 3)


@pytest.mark.parametrize("K", [1, 2, 4, L + 1])
def test_depth_read_equals_short_window_attention_over_depth(K):
    g = torch.Generator().manual_seed(K)
    H = torch.randn(L + 1, T, B, D, generator=g, requires_grad=True)
    weights = [(torch.randn(D, D, generator=g) / math.sqrt(D)).requires_grad_() for _ in range(3)]
    expected = depth_read_by_definition(H, *weights, K)
    actual = depth_read_as_window_attention(H, *weights, K)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)

    upstream = torch.randn(expected.shape, generator=g)
    grads_expected = torch.autograd.grad(expected, [H, *weights], upstream)
    grads_actual = torch.autograd.grad(actual, [H, *weights], upstream)
    for got, want in zip(grads_actual, grads_expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_k1_reads_only_the_current_state():
    H = torch.randn(L + 1, T, B, D)
    eye = torch.eye(D)
    torch.testing.assert_close(depth_read_as_window_attention(H, eye, eye, eye, 1), H)


def test_both_designs_call_the_one_operator():
    from t2train.kernels import dispatch
    from t2train.residual import shortswa

    assert depth_attn.short_window_attention is dispatch.short_window_attention
    assert shortswa.short_window_attention is dispatch.short_window_attention


def test_window_covering_the_sequence_is_full_causal_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 4, generator=g) for _ in range(3))
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(short_window_attention(q, k, v, 10), full)
    torch.testing.assert_close(short_window_attention(q, k, v, 64), full)
    assert not torch.allclose(short_window_attention(q, k, v, 3), full)


def test_window_mask_bands():
    mask = window_attention.window_mask(4, 4, 2)
    assert mask.tolist() == [[True, False, False, False], [True, True, False, False],
                             [False, True, True, False], [False, False, True, True]]
    # One query aligned to the end sees the last `window` keys.
    assert window_attention.window_mask(1, 5, 3).tolist() == [[False, False, True, True, True]]


def test_reference_passes_gradcheck_in_fp64():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 3, dtype=torch.float64, generator=g, requires_grad=True)
               for _ in range(3))
    assert torch.autograd.gradcheck(lambda a, b, c: short_window_attention(a, b, c, 3),
                                    (q, k, v))
