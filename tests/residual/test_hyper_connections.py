"""`hc` (Hyper-Connections, arXiv 2409.19606) and `mhc` (Manifold-Constrained
Hyper-Connections, arXiv 2512.24880) against their formulas, written out again here.

fp64, one layer with the local mixer on (three sublayers, each with its own connection),
every parameter moved off its initial value: the layer's output and its gradients (the input
streams' and every parameter's) equal the formulas'. Then: Sinkhorn's H_res is doubly
stochastic to 1e-6, n = 1 is a gated standard residual, both designs start as `standard`
(mHC exactly when its gates start at 0), the stream crosses a hop as n units, and the config
refuses values that cannot work.
"""

from __future__ import annotations

import pytest
import torch

from t2train.bench.plan import plan_layout
from t2train.config.loader import load_config
from t2train.config.schema import ConfigError
from t2train.model.build import build_model_chunks, transformer_config
from t2train.residual import get_design

SHAPE = [
    "data.path=unused",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=64",
    "model.seq_length=8",
    "model.vocab_size=128",
]
SEQ, BATCH, HIDDEN = 8, 2, 32


def _model(design: str, *extra: str, layers: int = 1, seed: int = 0):
    config = load_config(
        overrides=[*SHAPE, f"model.num_layers={layers}", f"model.residual={design}", *extra]
    )
    torch.manual_seed(seed)
    [model] = build_model_chunks(config, transformer_config(config), vocab_size=128)
    return model.double()


def _perturbed_layer(design: str, *extra: str):
    """Layer 1 of a one-layer fp64 model with the mixer on, every parameter moved."""
    model = _model(design, "model.shortswa.window=3", *extra)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model.decoder.layers[0], model.rotary_pos_emb(SEQ)


def _streams(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, SEQ, BATCH, HIDDEN, dtype=torch.float64, generator=g)


def _sublayers(layer, rope):
    """(connection, norm, F) of the mixer's sublayer, attention and the MLP, in order."""

    def attend(module):
        def run(normed):
            out, bias = module(normed, attention_mask=None, rotary_pos_emb=rope)
            return out if bias is None else out + bias

        return run

    def mlp(normed):
        out, bias = layer.mlp(normed)
        return out if bias is None else out + bias

    return [
        (layer.pre_attention_residual, layer.pre_attention_layernorm, attend(layer.pre_attention)),
        (layer.attn_residual, layer.input_layernorm, attend(layer.self_attention)),
        (layer.mlp_residual, layer.pre_mlp_layernorm, mlp),
    ]


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def hyper_connection(H, conn, norm, F, dynamic=True):
    """HC: x = A_m^T H, H' = A_r^T H + B^T F(Norm(x)); dynamic: A(H) = s tanh(H~ W) + A
    with H~ the streams normalised one by one; row i of A and entry i of B from stream i."""
    n = H.shape[0]
    static = conn.static_alpha  # [n, 1 + n]: A_m, then A_r
    alpha = [[static[i, k].expand(SEQ, BATCH) for k in range(n + 1)] for i in range(n)]
    beta = [conn.static_beta[i].expand(SEQ, BATCH) for i in range(n)]
    if dynamic:
        for i in range(n):
            h_norm = _rms(H[i], 1e-5) * conn.norm.weight
            for k in range(n + 1):
                alpha[i][k] = alpha[i][k] + conn.dynamic_alpha_scale * torch.tanh(
                    h_norm @ conn.dynamic_alpha[:, k]
                )
            beta[i] = beta[i] + conn.dynamic_beta_scale * torch.tanh(h_norm @ conn.dynamic_beta)
    x = sum(alpha[i][0].unsqueeze(-1) * H[i] for i in range(n))
    out = F(norm(x))
    return torch.stack(
        [
            sum(alpha[i][1 + j].unsqueeze(-1) * H[i] for i in range(n))
            + beta[j].unsqueeze(-1) * out
            for j in range(n)
        ]
    )


def sinkhorn_knopp(logits, iterations):
    """Sinkhorn-Knopp, mHC's Eq. 9: M(0) = exp(L), M(t) = T_r(T_c(M(t-1))), with T_c dividing
    each column by its sum and T_r each row."""
    m = torch.exp(logits)
    for _ in range(iterations):
        m = m / m.sum(-2, keepdim=True)
        m = m / m.sum(-1, keepdim=True)
    return m


def mhc_mappings(H, conn, iterations):
    """The mappings from vec(x_l): H_pre [s, b, n], H_post [s, b, n], H_res [s, b, n, n]."""
    n = H.shape[0]
    flat = H.permute(1, 2, 0, 3).reshape(SEQ, BATCH, n * HIDDEN)  # vec: stream after stream
    mapped = _rms(flat, 1e-6) @ conn.projection.T
    a_pre, a_post, a_res = conn.gates
    pre = torch.sigmoid(a_pre * mapped[..., :n] + conn.bias[:n])
    post = 2 * torch.sigmoid(a_post * mapped[..., n : 2 * n] + conn.bias[n : 2 * n])
    res_logits = (a_res * mapped[..., 2 * n :] + conn.bias[2 * n :]).reshape(SEQ, BATCH, n, n)
    return pre, post, sinkhorn_knopp(res_logits, iterations)


def manifold_hyper_connection(H, conn, norm, F, iterations=20):
    """mHC: x_{l+1} = H_res x_l + H_post^T F(H_pre x_l)."""
    n = H.shape[0]
    pre, post, res = mhc_mappings(H, conn, iterations)
    out = F(norm(sum(pre[..., j, None] * H[j] for j in range(n))))
    return torch.stack(
        [
            sum(res[..., i, j, None] * H[j] for j in range(n)) + post[..., i, None] * out
            for i in range(n)
        ]
    )


def _assert_layer_matches(layer, rope, H, formula):
    """Output and the gradients of the input and of every parameter of the layer."""
    params = list(layer.parameters())
    weights = torch.randn_like(H)
    got_in, want_in = H.clone().requires_grad_(), H.clone().requires_grad_()
    got = layer(got_in, None, rope)
    want = formula(want_in)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    got_grads = torch.autograd.grad((got * weights).sum(), [got_in, *params])
    want_grads = torch.autograd.grad((want * weights).sum(), [want_in, *params])
    for index, (a, b) in enumerate(zip(got_grads, want_grads)):
        torch.testing.assert_close(
            a,
            b,
            atol=1e-10,
            rtol=1e-10,
            msg=lambda m, i=index: f"gradient {i} ({'input' if i == 0 else 'parameter'}): {m}",
        )


def _compose(formula, layer, rope, **kwargs):
    def run(H):
        for conn, norm, F in _sublayers(layer, rope):
            H = formula(H, conn, norm, F, **kwargs)
        return H

    return run


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_hc_layer_is_the_papers_formula(megatron_world, dynamic):
    layer, rope = _perturbed_layer("hc", f"model.hc.dynamic={str(dynamic).lower()}")
    _assert_layer_matches(
        layer, rope, _streams(4), _compose(hyper_connection, layer, rope, dynamic=dynamic)
    )


@pytest.mark.parametrize("n", [4, 3])
def test_mhc_layer_is_the_papers_formula(megatron_world, n):
    layer, rope = _perturbed_layer("mhc", f"model.mhc.expansion_rate={n}")
    _assert_layer_matches(
        layer, rope, _streams(n), _compose(manifold_hyper_connection, layer, rope)
    )


def test_every_sublayer_has_its_own_connection(megatron_world):
    for design in ("hc", "mhc"):
        layer, rope = _perturbed_layer(design)
        connections = [conn for conn, _, _ in _sublayers(layer, rope)]
        assert len({id(next(c.parameters())) for c in connections}) == 3


def test_mhc_residual_mixing_is_doubly_stochastic(megatron_world):
    """After 20 iterations on logits spread over about 2 (gates 0.2, biases moved by 0.5):
    rows and columns sum to 1 within 1e-6. (Rows are exact by construction, T_r runs last;
    columns converge more slowly for wider spreads, arXiv 2601.05732.)"""
    from t2train.residual.mhc.functional import sinkhorn

    layer = _model("mhc", "model.shortswa.window=3").decoder.layers[0]
    H = _streams(4)
    for conn in (layer.pre_attention_residual, layer.attn_residual, layer.mlp_residual):
        with torch.no_grad():
            conn.gates.fill_(0.2)
            conn.bias.add_(0.5 * torch.randn_like(conn.bias))
        _, _, res_logits = conn.logits(H)
        assert (res_logits.amax((-2, -1)) - res_logits.amin((-2, -1))).max() > 1.5
        mixing = sinkhorn(res_logits, 20)
        ones = torch.ones(SEQ, BATCH, 4, dtype=torch.float64)
        assert (mixing > 0).all()
        torch.testing.assert_close(mixing.sum(-1), ones, atol=1e-14, rtol=0)
        torch.testing.assert_close(mixing.sum(-2), ones, atol=1e-6, rtol=0)
        torch.testing.assert_close(mixing, sinkhorn_knopp(res_logits, 20), atol=1e-12, rtol=0)


def test_the_trainers_normed_projection_is_the_exports_formula():
    """The trainer's memory-saving RMSNorm(vec x) phi^T (recomputed in its backward) equals
    the formula the export computes with (``flat_rms_projection``), forward and every
    gradient, in fp64; both against the formula written out here."""
    from t2train.residual.mhc.functional import flat_rms_projection
    from t2train.residual.mhc.layers import normed_projection

    g = torch.Generator().manual_seed(3)
    n, eps = 3, 1e-6
    state = torch.randn(n, SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64)
    phi = torch.randn(n * n + 2 * n, n * HIDDEN, generator=g, dtype=torch.float64)
    flat = state.permute(1, 2, 0, 3).reshape(SEQ, BATCH, n * HIDDEN)
    written_out = flat / flat.pow(2).mean(-1, keepdim=True).add(eps).sqrt() @ phi.T
    upstream = torch.randn(written_out.shape, generator=g, dtype=torch.float64)
    results = []
    for projection in (flat_rms_projection, normed_projection):
        x, w = state.clone().requires_grad_(), phi.clone().requires_grad_()
        out = projection(x, w, eps)
        (out * upstream).sum().backward()
        results.append((out.detach(), x.grad, w.grad))
    torch.testing.assert_close(results[0][0], written_out, atol=1e-12, rtol=0)
    for got, formula in zip(results[1], results[0]):
        torch.testing.assert_close(got, formula, atol=1e-12, rtol=1e-12)


def test_with_one_stream_both_are_gated_standard_residuals(megatron_world):
    """n = 1: HC is h' = A_r h + B F(Norm(A_m h)) with three (dynamic) scalar gates; mHC is
    x' = x + 2 sigmoid(q) F(Norm(sigmoid(p) x)), since Sinkhorn of a 1 x 1 matrix is 1."""
    from t2train.residual.mhc.functional import sinkhorn

    torch.testing.assert_close(
        sinkhorn(torch.randn(5, 1, 1, dtype=torch.float64), 20),
        torch.ones(5, 1, 1, dtype=torch.float64),
        atol=0,
        rtol=0,
    )
    h = _streams(1)
    layer, rope = _perturbed_layer("hc", "model.hc.expansion_rate=1")
    conn, norm, F = _sublayers(layer, rope)[1]
    x = h[0]
    h_norm = _rms(x, 1e-5) * conn.norm.weight
    gate_read = conn.static_alpha[0, 0] + conn.dynamic_alpha_scale * torch.tanh(
        h_norm @ conn.dynamic_alpha[:, 0]
    )
    gate_res = conn.static_alpha[0, 1] + conn.dynamic_alpha_scale * torch.tanh(
        h_norm @ conn.dynamic_alpha[:, 1]
    )
    gate_write = conn.static_beta[0] + conn.dynamic_beta_scale * torch.tanh(
        h_norm @ conn.dynamic_beta
    )
    want = gate_res[..., None] * x + gate_write[..., None] * F(norm(gate_read[..., None] * x))
    read = conn.read(h)
    state = conn.write(h, read, None, F(norm(read)))
    torch.testing.assert_close(state[0], want, atol=1e-12, rtol=0)

    layer, rope = _perturbed_layer("mhc", "model.mhc.expansion_rate=1")
    conn, norm, F = _sublayers(layer, rope)[2]
    mapped = _rms(x, 1e-6) @ conn.projection.T  # [s, b, 3]: p, q and the (unused) mixing
    read = torch.sigmoid(conn.gates[0] * mapped[..., :1] + conn.bias[0])
    write = 2 * torch.sigmoid(conn.gates[1] * mapped[..., 1:2] + conn.bias[1])
    want = x + write * F(norm(read * x))
    read = conn.read(h)
    state = conn.write(h, read, None, F(norm(read)))
    torch.testing.assert_close(state[0], want, atol=1e-12, rtol=0)


def _logits(model):
    tokens = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None)


@pytest.mark.parametrize(
    "variant",
    [
        ["model.residual=hc"],
        ["model.residual=hc", "model.hc.dynamic=false"],
        ["model.residual=hc", "model.shortswa.window=3"],
        ["model.residual=mhc", "model.mhc.gate_init=0"],
        ["model.residual=mhc", "model.mhc.gate_init=0", "model.shortswa.window=3"],
    ],
    ids=["hc", "hc_static", "hc+shortswa", "mhc_gate0", "mhc_gate0+shortswa"],
)
def test_starts_as_standard(megatron_world, variant):
    """Same logits as `standard` at initialisation with the shared weights copied. (mHC: its
    b_pre = logit(1/n) is stored in fp32, so sum_j H_pre[j] = 1 +- 2e-8.)"""
    mixer = [v for v in variant if "shortswa" in v]
    standard = _model("standard", *mixer, layers=3, seed=1)
    design = _model(variant[0].split("=")[1], *variant[1:], layers=3, seed=2)
    missing, unexpected = design.load_state_dict(standard.state_dict(), strict=False)
    assert not unexpected and missing and all("_residual." in key for key in missing)
    tolerance = 1e-9 if "mhc" in variant[0] else 1e-12
    torch.testing.assert_close(_logits(design), _logits(standard), atol=tolerance, rtol=0)


def test_mhc_with_its_default_gates_starts_near_standard(megatron_world):
    """gate_init = 0.01: H_pre and H_post move O(a |x' phi|) off 1/n and 1."""
    standard = _model("standard", layers=3, seed=1)
    design = _model("mhc", layers=3, seed=2)
    design.load_state_dict(standard.state_dict(), strict=False)
    got, want = _logits(design), _logits(standard)
    assert 0 < (got - want).norm() < 0.05 * want.norm()


@pytest.mark.parametrize("design, n", [("hc", 4), ("mhc", 3)])
def test_the_stream_crosses_a_hop_as_n_units(megatron_world, design, n):
    config = load_config(
        overrides=[
            *SHAPE,
            "model.num_layers=4",
            f"model.residual={design}",
            f"model.{design}.expansion_rate={n}",
            "parallel.pipeline=2",
            "train.micro_batch_size=1",
            "train.global_batch_size=2",
        ]
    )
    stream = (
        get_design(design)
        .modules()
        .stream(transformer_config(config), config.model, False, False, 2)
    )
    state = _streams(n)
    units = stream.to_units(state)
    assert len(units) == n and get_design(design).unit_ids(config.model, 2) == [None] * n
    assert all(u.shape == (SEQ, BATCH, HIDDEN) for u in units)
    assert torch.equal(stream.from_units(units, 2), state)
    plan = plan_layout(config, vocab_size=128, world_size=2)
    assert plan.naive.hop_units() == [n] and plan.step_bytes(plan.naive, wire=True) == (
        n * plan.unit_bytes * plan.micro_batches
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.hc.expansion_rate=0", "model.hc.expansion_rate=0: must be >= 1"),
        ("model.hc.dynamic_scale_init=0", "model.hc.dynamic_scale_init=0.0: must be > 0"),
        ("model.mhc.expansion_rate=0", "model.mhc.expansion_rate=0: must be >= 1"),
        ("model.mhc.sinkhorn_iterations=0", "model.mhc.sinkhorn_iterations=0: must be >= 1"),
        ("model.mhc.gate_init=-0.1", "model.mhc.gate_init=-0.1: must be >= 0"),
        ("model.mhc.eps=0", "model.mhc.eps=0.0: must be > 0"),
    ],
)
def test_invalid_options(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[*SHAPE, override])
    assert message in str(err.value)
