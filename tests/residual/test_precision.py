"""Under bf16 (bf16 parameters, or fp32 parameters under CPU autocast) the designs' gate logits,
softmax scores and normalisation statistics are computed in fp32 (docs/residuals.md,
"Numerics"): each is compared bitwise with the same formula written out in fp32."""

import pytest
import torch
import torch.nn.functional as F

from t2train.config.loader import load_config
from t2train.model.build import transformer_config
from t2train.nn.precision import fp32_linear, rms_fp32_logits
from t2train.residual.attnres import layers as attnres
from t2train.residual.ddl import layers as ddl

BF16 = torch.bfloat16


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_fp32_linear_from_bf16_inputs_and_weights():
    linear = torch.nn.Linear(48, 3, dtype=BF16)
    x = _randn(5, 2, 48, dtype=BF16).requires_grad_()
    out = fp32_linear(x, linear)
    want = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    assert out.dtype == torch.float32
    assert torch.equal(out, want)
    assert not torch.equal(linear(x).float(), want)  # what bf16 logits would have been
    grad = _randn(5, 2, 3, seed=1)
    out.backward(grad)
    x_ref = x.detach().float().requires_grad_()
    w_ref = linear.weight.detach().float().requires_grad_()
    F.linear(x_ref, w_ref, linear.bias.detach().float()).backward(grad)
    assert x.grad.dtype == BF16 and linear.weight.grad.dtype == BF16
    torch.testing.assert_close(x.grad, x_ref.grad.to(BF16), atol=0, rtol=0)
    torch.testing.assert_close(linear.weight.grad, w_ref.grad.to(BF16), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(linear.bias.grad.float(), grad.sum((0, 1)), atol=1e-2, rtol=1e-2)


def test_fp32_linear_ignores_autocast():
    linear = torch.nn.Linear(48, 3)
    x = _randn(5, 2, 48)
    with torch.autocast("cpu", dtype=BF16):
        assert linear(x).dtype == BF16  # autocast would lower a plain linear
        out = fp32_linear(x, linear)
    assert out.dtype == torch.float32 and torch.equal(out, linear(x))


@pytest.fixture
def ddl_bf16():
    config = load_config(
        overrides=[
            "data.path=unused",
            "model.num_layers=2",
            "model.hidden_size=48",
            "model.num_attention_heads=4",
            "model.residual=ddl",
            "model.ddl.dv=2",
            "train.precision=bf16",
        ]
    )
    torch.manual_seed(0)
    return ddl.DeltaResidual(transformer_config(config), config.model, layer_number=1, position=0)


def test_ddl_gate_logits_are_fp32_with_bf16_parameters(ddl_bf16):
    residual = ddl_bf16
    assert residual.beta_proj.weight.dtype == BF16
    state, x = _randn(2, 5, 2, 48, dtype=BF16), _randn(5, 2, 48, dtype=BF16, seed=1)
    normed, out = _randn(5, 2, 48, dtype=BF16, seed=2), _randn(5, 2, 48, dtype=BF16, seed=3)
    got = residual.write(state, x, normed, out)

    def fp32(linear, inputs):
        return F.linear(inputs.float(), linear.weight.float(), linear.bias.float())

    want = ddl.delta_write(
        state,
        out,
        fp32(residual.beta_proj, normed),
        fp32(residual.v_proj, x),
        residual.k_eps,
        residual.v_scale,
    )
    assert got.dtype == BF16 and torch.equal(got, want)
    bf16_logits = ddl.delta_write(
        state, out, residual.beta_proj(normed), residual.v_proj(x), residual.k_eps, residual.v_scale
    )
    assert not torch.equal(got, bf16_logits)


def test_ddl_gate_logits_are_fp32_under_autocast(ddl_bf16):
    residual = ddl_bf16.float()
    state, x = _randn(2, 5, 2, 48), _randn(5, 2, 48, seed=1)
    normed, out = _randn(5, 2, 48, seed=2), _randn(5, 2, 48, seed=3)
    with torch.autocast("cpu", dtype=BF16):
        got = residual.write(state, x, normed, out)
    assert torch.equal(got, residual.write(state, x, normed, out))


def test_attnres_scores_and_softmax_are_fp32_under_autocast_and_bf16():
    sources = [_randn(5, 2, 48, seed=n) * (1 + n) for n in range(4)]
    queries, partial = _randn(3, 48, seed=9), _randn(5, 2, 48, seed=10)
    stacks = [torch.stack(sources[:3]), sources[3].unsqueeze(0)]
    plain = (
        attnres.depth_mix(queries[0], stacks, 1e-6),
        attnres.block_phase_1(queries, stacks, 1e-6),
        attnres.mixing_weights(queries[0], stacks, 1e-6),
    )
    with torch.autocast("cpu", dtype=BF16):
        mixed = (
            attnres.depth_mix(queries[0], stacks, 1e-6),
            attnres.block_phase_1(queries, stacks, 1e-6),
            attnres.mixing_weights(queries[0], stacks, 1e-6),
        )
        out, lse = mixed[1]
        merged = attnres.block_phase_2(partial, queries[1], out[1], lse[1], 1e-6)
    assert torch.equal(mixed[0], plain[0]) and torch.equal(mixed[2], plain[2])
    assert all(torch.equal(a, b) for a, b in zip(mixed[1], plain[1]))
    assert torch.equal(merged, attnres.block_phase_2(partial, queries[1], out[1], lse[1], 1e-6))
    # bf16 sources: the mixture is computed from their fp32 values and rounded once.
    low, query = [s.to(BF16) for s in stacks], queries[0].to(BF16)
    want = attnres.depth_mix(query.float(), [s.float() for s in low], 1e-6).to(BF16)
    assert torch.equal(attnres.depth_mix(query, low, 1e-6), want)


def test_rmsnorm_statistics_are_fp32_for_bf16_inputs():
    """The pre-norms (and depth_attn's) use torch's RMSNorm: fp32 statistics, one rounding."""
    norm = torch.nn.RMSNorm(48, eps=1e-5, dtype=BF16)
    with torch.no_grad():
        norm.weight.normal_()
    x = _randn(5, 2, 48, dtype=BF16) * 3
    xf = x.float()
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.float()
    assert torch.equal(norm(x), want.to(BF16))


EPS = 1e-5


def _inputs(n_out: int, dtype, bias: bool):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 7, 40, generator=g)
    x = x * torch.linspace(0.1, 3.0, 7)[:, None]  # rows of different scales: the RMS matters
    weight = torch.randn(n_out, 40, generator=g) * 0.3
    b = torch.randn(n_out, generator=g) if bias else None
    return x.to(dtype), weight, b


def _rms_logits(x, weight, bias):
    """HC's dynamic-weight logits: RMSNorm without weight (x / sqrt(mean(x^2) + eps)) per row,
    then x W^T + b, summed in fp32."""
    x = x.double()
    normed = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)
    y = (normed[..., None, :] * weight.double()).sum(-1)
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_out, bias", [(6, False), (1, True), (24, True)])
def test_rms_logits_and_their_gradients(dtype, n_out, bias):
    """fp32 logits from fp32 or low-precision rows and fp32 weights (HC folds its fp32-cast
    norm weight into the projection), and every input's gradient, as the formula's."""
    x, weight, b = _inputs(n_out, dtype, bias)
    ours = [t.clone().requires_grad_() if t is not None else None for t in (x, weight, b)]
    theirs = [t.detach().double().requires_grad_() if t is not None else None for t in ours]
    out = rms_fp32_logits(*ours, EPS)
    assert out.dtype == torch.float32
    expected = _rms_logits(*theirs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    out.backward(upstream)
    expected.backward(upstream.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    for a, e in zip(ours, theirs):
        if a is not None:
            torch.testing.assert_close(a.grad.double(), e.grad, atol=tol, rtol=tol)


def test_rms_logits_keep_only_their_inputs_for_the_backward():
    """The normalised rows are recomputed in the backward: what autograd keeps is x and W
    themselves, no fp32 copy of x (2 units per unit of x in a bf16 model)."""
    x, weight, _ = _inputs(6, torch.bfloat16, bias=False)
    x.requires_grad_()
    weight.requires_grad_()
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        rms_fp32_logits(x, weight, None, EPS).sum().backward()
    assert x.grad is not None and weight.grad is not None
    big = [t for t in kept if t.numel() >= x.numel()]
    assert big and all(t.dtype == torch.bfloat16 for t in big)
    assert {t.untyped_storage().data_ptr() for t in big} == {x.untyped_storage().data_ptr()}


def test_stream_projections_are_fp32_under_autocast():
    """HC's per-stream and mHC's flattened RMS-normalised projections, from fp32 streams and
    weights under bf16 autocast, are the fp32 formulas' (their matmuls would otherwise run
    in bf16: errors near 1e-1 at these scales)."""
    from t2train.residual.mhc.layers import normed_projection

    n, h, eps = 4, 40, 1e-6
    scales = torch.linspace(0.1, 3.0, 5)[:, None, None]
    state = _randn(n, 5, 2, h) * scales
    phi = _randn(n * n + 2 * n, n * h, seed=1) * 0.3
    flat = state.double().permute(1, 2, 0, 3).reshape(5, 2, n * h)  # stream after stream
    mhc_want = flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + eps) @ phi.double().T
    weight = _randn(n + 2, h, seed=2) * 0.3
    with torch.autocast("cpu", dtype=BF16):
        mhc_out = normed_projection(state, phi, eps)
        hc_out = rms_fp32_logits(state, weight, None, EPS)
    assert mhc_out.dtype == hc_out.dtype == torch.float32
    torch.testing.assert_close(mhc_out.double(), mhc_want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        hc_out.double(), _rms_logits(state, weight, None), atol=1e-5, rtol=1e-5
    )
