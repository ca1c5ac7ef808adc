"""The duality as a test: the model's depth read is its sequence ShortSWA over the depth axis.

Residual Stream Duality (arXiv 2603.16039, Sec. 2.2): for a stack of residual states
H [L+1, T, B, d], the causal depth read of window K at layer l (query from h^(l), keys and
values from h^(max(0, l-K+1)) .. h^(l)) is causal sliding-window attention of window K over
the sequence X_t = [h_t^(0) .. h_t^(L)], whose index is the layer number.

Three computations of the same z for every layer must agree in value and in the gradients of
H and of the read's weights (fp64, 1e-10):
* the model's ``DepthRead`` (the layer entry of a built `depth_attn` model), driven layer by
  layer through its own window bookkeeping (``begin``);
* the model's ShortSWA core attention (from a built `shortswa` model with window K) applied
  once to the transposed stack, depth as the sequence axis and (T, B) folded into the batch,
  with the read's projections;
* the definition, a per-token loop (``paper_math.depth_read``).
"""

import paper_math as paper
import pytest
import torch
from built import EPS, HEADS, HIDDEN, build_decoder, random

from t2train.residual.depth_attn.layers import DepthState
from t2train.residual.functional import short_window_attention, window_mask

L, T, B = 5, 3, 2
D = HIDDEN // HEADS


def model_depth_read(read, H):
    """W_O z^(l) for l = 0..L from ``DepthRead.begin``, fed h^(l) as each layer's input."""
    history, outputs = (), []
    for layer in range(L + 1):
        new = read.begin(DepthState(history, H[layer]))
        outputs.append(new.current - H[layer])
        kept = H[max(0, layer - read.window + 2) : layer + 1] if read.window > 1 else H[:0]
        assert len(new.history) == len(kept) and all(
            torch.equal(a, b) for a, b in zip(new.history, kept)
        ), "history is not the window"
        history = new.history
    return torch.stack(outputs)


def shortswa_over_depth(core, w, H):
    """The sequence ShortSWA core attention on X_t = [h_t^(0) .. h_t^(L)], same projections."""
    normed = paper.rms_norm(H, w["norm"], EPS).reshape(L + 1, T * B, HIDDEN)
    q = (normed @ w["q"].T).view(L + 1, T * B, HEADS, D)
    kv = (normed @ w["kv"].T).view(L + 1, T * B, HEADS, 2, D)
    z = core(q, kv[..., 0, :], kv[..., 1, :], None)  # [L+1, T*B, h]
    return (z @ w["o"].T).view(L + 1, T, B, HIDDEN)


@pytest.mark.parametrize("K", [1, 2, 4, L + 1])
def test_the_models_depth_read_is_its_shortswa_over_depth(megatron_world, monkeypatch, K):
    monkeypatch.setenv("T2_KERNELS", "torch")
    read = (
        build_decoder(["model.residual=depth_attn", f"model.depth_attn.window={K}"], seed=K)
        .layers[0]
        .layer_entry
    )
    core = (
        build_decoder(["model.residual=standard", f"model.shortswa.window={K}"], randomised=False)
        .layers[0]
        .pre_attention.core_attention
    )
    w = {
        "norm": read.norm.weight,
        "q": read.linear_q.weight,
        "kv": read.linear_kv.weight,
        "o": read.linear_proj.weight,
    }
    H = random(L + 1, T, B, HIDDEN, seed=K).requires_grad_()

    by_depth = model_depth_read(read, H)
    by_sequence = shortswa_over_depth(core, w, H)
    weights = []
    by_definition = torch.stack(
        [
            paper.depth_read(w, list(H[: layer + 1]), HEADS, EPS, K, weights)
            for layer in range(L + 1)
        ]
    )
    leaves = [H, *w.values()]
    upstream = random(L + 1, T, B, HIDDEN, seed=10 + K)
    want = torch.autograd.grad(by_definition, leaves, upstream, retain_graph=True)
    for got in (by_depth, by_sequence):
        torch.testing.assert_close(got, by_definition, atol=1e-10, rtol=1e-10)
        for a, b in zip(torch.autograd.grad(got, leaves, upstream), want):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    if K > 1:  # the weights are far from uniform, so a wrong query or key would show
        assert max(p.max() - p.min() for p in weights) > 0.3


def test_window_covering_the_sequence_is_full_causal_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 4, generator=g, dtype=torch.float64) for _ in range(3))
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(short_window_attention(q, k, v, 10), full)
    torch.testing.assert_close(short_window_attention(q, k, v, 64), full)
    banded = torch.stack(
        [
            torch.stack(
                [paper.window_attention_1d(q[b, h], k[b, h], v[b, h], 3, 0.5) for h in range(3)]
            )
            for b in range(2)
        ]
    )
    torch.testing.assert_close(short_window_attention(q, k, v, 3), banded, atol=1e-12, rtol=0)


@pytest.mark.parametrize("window", [1, 3, 6, 9])
def test_a_single_query_attends_to_the_last_window_keys(window):
    """One query per head (a depth read's shape) takes its own path; the paper's formula
    with grouped-query heads (4 query heads on 2 key/value heads), values and gradients."""
    g = torch.Generator().manual_seed(window)
    q = torch.randn(2, 4, 1, 5, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(2, 2, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    earlier = torch.zeros(5, 5, dtype=torch.float64)  # queries at positions 0..4, unused
    want = torch.stack(
        [
            torch.stack(
                [
                    paper.window_attention_1d(
                        torch.cat([earlier, q[b, h]]), k[b, h // 2], v[b, h // 2], window, 0.7
                    )[-1:]
                    for h in range(4)
                ]
            )
            for b in range(2)
        ]
    )
    got = short_window_attention(q, k, v, window, 0.7)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    upstream = torch.randn(want.shape, generator=g, dtype=torch.float64)
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), upstream),
        torch.autograd.grad(want, (q, k, v), upstream),
    ):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_window_mask_bands():
    mask = window_mask(4, 4, 2)
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, True, True, False],
        [False, False, True, True],
    ]
    # One query aligned to the end sees the last `window` keys.
    assert window_mask(1, 5, 3).tolist() == [[False, False, True, True, True]]


def test_reference_passes_gradcheck_in_fp64():
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, 2, 6, 3, dtype=torch.float64, generator=g, requires_grad=True)
        for _ in range(3)
    )
    assert torch.autograd.gradcheck(lambda a, b, c: short_window_attention(a, b, c, 3), (q, k, v))
