"""Triton short window attention vs the PyTorch reference (interpreter on CPU)."""

import pytest
import torch

from t2train.residual.functional import short_window_attention
from t2train.residual.window_attention import attend_window

from kernel_checks import DEVICE, assert_matches

# batch, heads, kv_heads, q_len, k_len, head_dim, window
SHAPES = {
    "sequence": (1, 2, 2, 24, 24, 16, 5),
    "gqa": (1, 4, 2, 20, 20, 24, 7),
    "window_one": (1, 2, 1, 17, 17, 16, 1),
    "full_window": (1, 2, 2, 20, 20, 16, 64),
    # One query (the one-query kernels): more tokens than one program's rows, a single key,
    # window 1 with a 3:1 head group and a head dim off the powers of two.
    "depth_read": (6, 2, 2, 1, 3, 16, 4),
    "depth_truncated": (3, 2, 1, 1, 9, 16, 4),
    "depth_many_tokens": (37, 2, 2, 1, 4, 64, 4),
    "depth_one_key": (5, 2, 2, 1, 1, 16, 4),
    "depth_window_one": (5, 3, 1, 1, 6, 24, 1),
    "head_dim_128": (1, 1, 1, 18, 18, 128, 8),
    # Bands whose last query starts a new 16-row tile (the interpreter's tiles): a key tile's
    # dK/dV must still visit it (window 2: key 15 is seen by query 16; 18: by query 32).
    "tile_edge": (1, 1, 1, 20, 20, 16, 2),
    "tile_edge_wide": (1, 1, 1, 36, 36, 16, 18),
}


def _inputs(shape, dtype):
    b, h, hk, lq, lk, d, _ = shape
    g = torch.Generator().manual_seed(1)
    make = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    return make(b, h, lq, d), make(b, hk, lk, d), make(b, hk, lk, d)


def _check(shape, dtype):
    window, scale = shape[-1], shape[-2] ** -0.5
    assert_matches(
        lambda q, k, v: attend_window(q, k, v, window, scale),
        lambda q, k, v: short_window_attention(q, k, v, window, scale),
        _inputs(shape, dtype),
        dtype,
        "window_attention",
    )


@pytest.mark.parametrize("case", SHAPES)
def test_fp32(case):
    _check(SHAPES[case], torch.float32)


@pytest.mark.parametrize("case", ["sequence", "gqa", "depth_read", "depth_truncated"])
def test_fp16(case):
    _check(SHAPES[case], torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("case", SHAPES)
def test_bf16(case):
    _check(SHAPES[case], torch.bfloat16)


@pytest.mark.parametrize(
    "q_len, kernels",
    [
        (1, ["_one_query_fwd_kernel", "_one_query_bwd_kernel"]),
        (2, ["_fwd_kernel", "_delta_kernel", "_dkdv_kernel", "_dq_kernel"]),
    ],
)
def test_one_query_takes_its_own_kernels(monkeypatch, q_len, kernels):
    from t2train.kernels import window_attention

    from kernel_checks import run_kernels

    launched = []

    class Recorded:  # kernel[grid](...) records the kernel's name, then launches it
        def __init__(self, name):
            self.name, self.kernel = name, getattr(window_attention, name)

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in (
        "_fwd_kernel",
        "_delta_kernel",
        "_dkdv_kernel",
        "_dq_kernel",
        "_one_query_fwd_kernel",
        "_one_query_bwd_kernel",
    ):
        monkeypatch.setattr(window_attention, name, Recorded(name))
    q, k, v = _inputs((4, 2, 2, q_len, 3, 16, 2), torch.float32)
    run_kernels(attend_window, q.requires_grad_(), k, v, 2).sum().backward()
    assert launched == kernels


def test_depth_read_views_as_the_model_passes_them():
    """depth_attn folds the window into the batch ([s, b * n, h]): k and v are strided views
    of one projection, and so is q here."""
    tokens, heads, n, d = 5, 2, 3, 16
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(tokens, n, 2, heads, d, generator=g).to(DEVICE)
    k, v = (kv[:, :, i].permute(0, 2, 1, 3) for i in range(2))  # [tokens, heads, n, d] views
    q = torch.randn(tokens, heads, 2 * d, generator=g).to(DEVICE)[..., :d].unsqueeze(2)
    assert not k.is_contiguous() and not q.is_contiguous()
    assert_matches(
        lambda q, k, v: attend_window(q, k, v, 2),
        lambda q, k, v: short_window_attention(q, k, v, 2),
        (q, k, v),
        torch.float32,
        "window_attention",
    )


def test_strided_inputs_and_default_scale():
    """[s, b, h, d] activations permuted to [b, h, s, d], as the core attention passes them."""
    q, k, v = (
        t.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
        for t in _inputs(SHAPES["gqa"], torch.float32)
    )
    assert not q.is_contiguous()
    assert_matches(
        lambda q, k, v: attend_window(q, k, v, 6),
        lambda q, k, v: short_window_attention(q, k, v, 6),
        (q, k, v),
        torch.float32,
        "window_attention",
    )


def test_gradients_keep_the_models_layout():
    """The mixer hands the kernel [s, b, heads, d] memory as [b, heads, s, d] views: the
    gradients come back in that memory layout (RoPE's and the QKV split's backward then read
    one layout), and equal the reference's."""
    from kernel_checks import leaves, run_kernels

    q, k, v = (
        t.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
        for t in _inputs(SHAPES["gqa"], torch.float32)
    )
    ours, theirs = leaves(q, k, v), leaves(q, k, v)
    out = run_kernels(attend_window, *ours, 6)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, ours, grad)
    want = torch.autograd.grad(short_window_attention(*theirs, 6), theirs, grad)
    for a, b, inp in zip(got, want, (q, k, v)):
        assert a.stride() == inp.stride(), (a.stride(), inp.stride())
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_reference_passes_gradcheck():
    q, k, v = (t.double().requires_grad_() for t in _inputs(SHAPES["gqa"], torch.float32))
    q, k, v = q[:, :2, :4, :4], k[:, :1, :6, :4], v[:, :1, :6, :4]
    assert torch.autograd.gradcheck(lambda *t: short_window_attention(*t, 3, 0.5), (q, k, v))


@pytest.mark.parametrize(
    "shape",
    [
        (32768, 12, 12, 1, 4, 64),  # 125m depth read: one query per token, 393,216 (token, head)
        (16, 12, 12, 2048, 2048, 64),  # 125m sequence
        (4, 16, 8, 4096, 4096, 128),  # 1b sequence, grouped heads
    ],
)
def test_launch_grids_fit_cudas_limits(shape):
    """A CUDA grid holds 2^31 - 1 blocks on axis 0 but 65,535 on axes 1 and 2; the depth read
    of the 125m preset once put its 393,216 (token, head) pairs on axis 1 and failed to launch
    ("invalid argument") on an H100."""
    from t2train.kernels.window_attention import _grids, _tiles

    batch, heads, kv_heads, q_len, k_len, head_dim = shape
    grids = _grids(batch, heads, kv_heads, q_len, k_len, _tiles(q_len, head_dim))
    assert grids["rows"][0] == batch * heads and grids["keys"][0] == batch * kv_heads
    for grid in grids.values():
        assert grid[0] < 2**31 and all(blocks <= 65535 for blocks in grid[1:]), grids
