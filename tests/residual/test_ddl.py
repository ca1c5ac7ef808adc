"""Deep Delta Learning (arXiv 2601.00417): the operator's identities (Sec. 2), then the
model's DDL modules: the gate's range and regimes, where v comes from, k's normalisation,
the d_v > 1 expander and channel-mix reads, and the initialisation."""

import paper_math as paper
import pytest
import torch
from built import BATCH, HIDDEN, SEQ, build_decoder, random

from t2train.residual.ddl.functional import delta_update, normalized_direction


def _inputs(dv: int, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    columns = () if dv == 1 else (dv,)  # the matrix state is stored column-major
    state = torch.randn(*columns, 3, 2, 16, generator=g, dtype=dtype)
    k = normalized_direction(torch.randn(3, 2, 16, generator=g, dtype=dtype), eps=0.0)
    v = torch.randn(*columns, 3, 2, 1, generator=g, dtype=dtype)
    return state, k.to(dtype), v


def _readout(state, k):
    return (k * state).sum(-1, keepdim=True)


@pytest.mark.parametrize("dv", [1, 4])
def test_beta_zero_is_identity(dv):
    state, k, v = _inputs(dv)
    beta = torch.zeros(3, 2, 1, dtype=state.dtype)
    assert torch.equal(delta_update(state, k, beta, v), state)


@pytest.mark.parametrize("dv", [1, 4])
def test_beta_one_overwrites_the_readout_with_v(dv):
    state, k, v = _inputs(dv)
    new = delta_update(state, k, torch.ones(3, 2, 1, dtype=state.dtype), v)
    torch.testing.assert_close(_readout(new, k), v, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dv", [1, 4])
def test_beta_two_reflects(dv):
    """With v = 0 the update is the Householder reflection I - 2kk^T: applied twice, identity."""
    state, k, _ = _inputs(dv)
    zero, two = torch.zeros_like(_readout(state, k)), torch.full((3, 2, 1), 2.0, dtype=state.dtype)
    once = delta_update(state, k, two, zero)
    torch.testing.assert_close(_readout(once, k), -_readout(state, k))  # k-component flipped
    torch.testing.assert_close(delta_update(once, k, two, zero), state)


def test_k_normalisation_is_guarded_at_zero():
    k = normalized_direction(torch.zeros(4, 8), eps=1e-5)
    assert torch.equal(k, torch.zeros(4, 8))
    unit = normalized_direction(torch.randn(4, 8) * 10, eps=1e-5)
    torch.testing.assert_close(unit.norm(dim=-1), torch.ones(4), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dv", [1, 4])
def test_update_passes_gradcheck_in_fp64(dv):
    state, k, v = _inputs(dv)
    beta = torch.rand(3, 2, 1, dtype=torch.float64) * 2
    args = [t.clone().requires_grad_() for t in (state, k, beta, v)]
    assert torch.autograd.gradcheck(delta_update, args)


# --- The DDL modules of a built model (fp64, weights off their init) -------------------------


def _ddl(dv: int, *extra: str, randomised: bool = True):
    return build_decoder(
        ["model.residual=ddl", f"model.ddl.dv={dv}", *extra], randomised=randomised
    )


def _write_inputs(dv: int):
    """A state, the sublayer input x read from it, a normalised context c != x, an output."""
    state = random(*(() if dv == 1 else (dv,)), SEQ, BATCH, HIDDEN, seed=3)
    c = random(SEQ, BATCH, HIDDEN, seed=4)
    return state, c, random(SEQ, BATCH, HIDDEN, seed=5)


def _columns(state, dv):
    return [state] if dv == 1 else list(state)


@pytest.mark.parametrize("dv", [1, 4])
def test_write_scales_the_k_error_by_one_minus_beta(megatron_world, monkeypatch, dv):
    """Sec. 2.1's error view through the model's sublayer residual, per state column j:
    k^T X_j' - v_j = (1 - beta)(k^T X_j - v_j), and X_j' - X_j is along k, with
    k = k~ / sqrt(|k~|^2 + eps^2), beta = 2 sigmoid(w . c + b) from the normalised context,
    v = 4 sigmoid(W_v x_in + b_v) from the raw (compressed) state x_in."""
    monkeypatch.setenv("T2_KERNELS", "torch")
    residual = _ddl(dv).layers[1].mlp_residual
    state, c, out = _write_inputs(dv)
    x = residual.read(state)
    new = residual.write(state, x, c, out)
    k = out / torch.sqrt(out.pow(2).sum(-1, keepdim=True) + 1e-10)
    beta = 2 * torch.sigmoid(c @ residual.beta_proj.weight.T + residual.beta_proj.bias)
    v = 4 * torch.sigmoid(x @ residual.v_proj.weight.T + residual.v_proj.bias)
    assert beta.min() < 0.7 and beta.max() > 1.3  # both regimes
    for j, (before, after) in enumerate(zip(_columns(state, dv), _columns(new, dv))):
        error = (k * before).sum(-1, keepdim=True) - v[..., j : j + 1]
        error_after = (k * after).sum(-1, keepdim=True) - v[..., j : j + 1]
        torch.testing.assert_close(
            error_after, (1 - beta * k.pow(2).sum(-1, keepdim=True)) * error, atol=1e-12, rtol=0
        )
        change = after - before
        along_k = (change * k).sum(-1, keepdim=True) * k / k.pow(2).sum(-1, keepdim=True)
        torch.testing.assert_close(change, along_k, atol=1e-12, rtol=0)
        assert (error - error_after).abs().max() > 0.1


@pytest.mark.parametrize("bias, beta", [(-60.0, 0.0), (0.0, 1.0), (60.0, 2.0)])
def test_gate_regimes_identity_overwrite_reflection(megatron_world, monkeypatch, bias, beta):
    """beta = 2 sigmoid(logit) spans (0, 2): logit -> -inf leaves X unchanged, 0 overwrites
    the readout with v (k^T X' = v), +inf reflects the error (k^T X' - v = -(k^T X - v))."""
    monkeypatch.setenv("T2_KERNELS", "torch")
    residual = _ddl(1).layers[0].attn_residual
    with torch.no_grad():
        residual.beta_proj.weight.zero_()
        residual.beta_proj.bias.fill_(bias)
    state, c, out = _write_inputs(1)
    new = residual.write(state, state, c, out)
    k = out / out.norm(dim=-1, keepdim=True)
    v = 4 * torch.sigmoid(state @ residual.v_proj.weight.T + residual.v_proj.bias)
    error = (k * state).sum(-1, keepdim=True) - v
    torch.testing.assert_close(
        (k * new).sum(-1, keepdim=True) - v, (1 - beta) * error, atol=1e-9, rtol=0
    )


def test_k_is_normalised_so_the_output_scale_does_not_matter(megatron_world, monkeypatch):
    monkeypatch.setenv("T2_KERNELS", "torch")
    residual = _ddl(1).layers[0].attn_residual
    state, c, out = _write_inputs(1)
    torch.testing.assert_close(
        residual.write(state, state, c, 1000 * out),
        residual.write(state, state, c, out),
        atol=1e-9,
        rtol=0,
    )


def test_expander_is_a_causal_depthwise_conv_starting_as_identity(megatron_world):
    """EC: X_j[t] = sum_lag c_{j,lag} * e[t - lag] per feature; at init every column is e."""
    embedding = random(SEQ, BATCH, HIDDEN, seed=6)
    stream = _ddl(4).stream
    expected = paper.ddl_expand(embedding, stream.expander.weight, 4)
    torch.testing.assert_close(stream.enter(embedding), torch.stack(expected), atol=1e-12, rtol=0)
    at_init = _ddl(4, randomised=False).stream.enter(embedding)
    assert all(torch.equal(column, embedding) for column in at_init)


def test_channel_mix_reads_start_as_the_mean(megatron_world):
    """CC: x_in[..., i] = sum_j c_ij X_j[..., i], for each sublayer and the final read;
    initialised to the column mean."""
    state = random(4, SEQ, BATCH, HIDDEN, seed=7)
    decoder = _ddl(4)
    residual = decoder.layers[2].attn_residual
    for read, mix in (
        (residual.read, residual.compressor.weight),
        (decoder.stream.exit, decoder.stream.final_read.weight),
    ):
        torch.testing.assert_close(
            read(state), paper.ddl_compress(list(state), mix), atol=1e-12, rtol=0
        )
    at_init = _ddl(4, randomised=False)
    for read in (at_init.layers[0].mlp_residual.read, at_init.stream.exit):
        torch.testing.assert_close(read(state), state.mean(0), atol=1e-12, rtol=0)


@pytest.mark.parametrize("beta_init", [0.5, 1.0, 1.5])
def test_gates_start_at_beta_init_and_v_bias_zero(megatron_world, beta_init):
    decoder = _ddl(1, f"model.ddl.beta_init={beta_init}", randomised=False)
    for layer in decoder.layers:
        for residual in (layer.attn_residual, layer.mlp_residual):
            beta = 2 * torch.sigmoid(residual.beta_proj.bias)
            torch.testing.assert_close(beta, torch.tensor([beta_init], dtype=beta.dtype))
            assert torch.equal(residual.v_proj.bias, torch.zeros_like(residual.v_proj.bias))
