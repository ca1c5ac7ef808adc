"""`hc`'s dynamic width connection for compiled code: the streams' norms and projections
(one pass over the streams), the tanh mappings and the read (fused into the pass of the
norm that follows), with a hand-written backward that recomputes the mappings from the
projections' logits, n + 3 fp32 numbers per stream and token.

Autograd of the same formula writes the projections' gradient with respect to the streams
as an fp32 [n, tokens, h] buffer and sums the streams' gradient in a pass of its own
(``t2train bench bytes``). Here the streams' gradient is one pointwise pass over [n, tokens,
h] in the state's dtype, into which the compiler also adds the write's.

Per token, stream i (h values), F [n + 2, h] the folded projections, r_i = (mean h_i^2 +
eps)^(-1/2), L_io = r_i h_i^T F_o, t_io = tanh(L_io):

    A_m[i] = A_m0[i] + s_a t_i0,   A_r[i, j] = A_r0[i, j] + s_a t_i(1+j)
    B[i] = B0[i] + s_b t_i(n+1)
    x = sum_i A_m[i] h_i

With the gradients of A_m (h_i^T dx), A_r and B, and d_io their logits' gradients (the
scale times the mapping's gradient times 1 - t_io^2):

    dh_i = A_m[i] dx + r_i sum_o d_io F_o - (r_i^2 / h) (sum_o d_io L_io) h_i
    dF_o = sum over tokens and streams of r_i d_io h_i
"""

from __future__ import annotations

import torch
from torch import Tensor

from t2train.nn.functional import at_least_fp32
from t2train.nn.precision import summed_products
from t2train.residual.hc.functional import connection_weights
from t2train.residual.unrolled import weighted_terms


class _WidthConnection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, folded, static_alpha, static_beta, alpha_scale, beta_scale, eps):
        # bf16 times fp32 is computed in fp32: no fp32 copy of the streams is made
        inverse_rms = torch.rsqrt(at_least_fp32(state).pow(2).mean(-1, keepdim=True) + eps)
        logits = summed_products(state, folded) * inverse_rms  # [n, ..., n + 2]
        tokens = state.shape[1:-1]
        alpha, beta = connection_weights(
            static_alpha, static_beta, tokens, logits, alpha_scale, beta_scale
        )
        ctx.save_for_backward(
            state, folded, static_alpha, alpha_scale, beta_scale, inverse_rms, logits
        )
        read_weights = alpha[..., 0]
        # the streams as ``unbind`` views (``weighted_sum`` indexes them): so written, the
        # compiler fuses the write's streams' gradient into this backward's (4.6 units per
        # sublayer fewer by ``t2train bench bytes``)
        streams = state.unbind(0)
        x = weighted_terms(streams, [read_weights[..., i, None] for i in range(len(streams))])
        x = x.to(state.dtype)
        ctx.mark_non_differentiable(read_weights)  # for diagnostics only
        return x, read_weights, alpha[..., 1:], beta

    @staticmethod
    def backward(ctx, grad_x, _grad_read_weights, grad_residual, grad_beta):
        state, folded, static_alpha, alpha_scale, beta_scale, inverse_rms, logits = (
            ctx.saved_tensors
        )
        n, h = state.shape[0], state.shape[-1]
        tanh = torch.tanh(logits)  # [n, ..., n + 2]
        grad_read = (state * grad_x).sum(-1, keepdim=True)  # dA_m, [n, ..., 1]
        grad_mappings = torch.cat(  # [n, ..., n + 2]: A_m, A_r's row, B
            [grad_read, grad_residual.movedim(-2, 0), grad_beta.movedim(-1, 0)[..., None]], -1
        )
        s_a, s_b = at_least_fp32(alpha_scale), at_least_fp32(beta_scale)
        scales = torch.cat([s_a.expand(n + 1), s_b])
        d = scales * grad_mappings * (1 - tanh * tanh)  # the logits' gradients
        read_weight = at_least_fp32(static_alpha[:, 0]).view(n, *[1] * (state.dim() - 1))
        read_weight = read_weight + s_a * tanh[..., :1]  # A_m, [n, ..., 1]
        coefficients = inverse_rms * d  # r_i d_io, [n, ..., n + 2]
        grad_state = (
            read_weight * grad_x
            - (inverse_rms * inverse_rms / h * (d * logits).sum(-1, keepdim=True)) * state
        )
        for o, f in enumerate(folded.unbind(0)):
            grad_state = grad_state + coefficients[..., o : o + 1] * f
        reduced = list(range(state.dim() - 1))  # the streams and the tokens
        grad_folded = torch.stack(
            [(coefficients[..., o : o + 1] * state).sum(reduced) for o in range(n + 2)]
        )
        over_tokens = list(range(1, state.dim() - 1))
        mapping_sums = grad_mappings.sum(over_tokens)  # [n, n + 2]
        scale_terms = (grad_mappings * tanh).sum(over_tokens)
        return (
            grad_state.to(state.dtype),
            grad_folded.to(folded.dtype),
            mapping_sums[:, : n + 1].to(static_alpha.dtype),
            mapping_sums[:, n + 1].to(static_alpha.dtype),
            scale_terms[:, : n + 1].sum().reshape(1).to(alpha_scale.dtype),
            scale_terms[:, n + 1].sum().reshape(1).to(beta_scale.dtype),
            None,
        )


def width_connection_fused(
    state: Tensor,
    folded: Tensor,
    static_alpha: Tensor,
    static_beta: Tensor,
    alpha_scale: Tensor,
    beta_scale: Tensor,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The read x [..., h] (the state's dtype), A_m [..., n] (not differentiable: for
    diagnostics), A_r [..., n, n] and B [..., n] (fp32) of a
    dynamic hyper-connection from the streams [n, ..., h] and the folded projections
    [n + 2, h] (``folded_projections``), for compiled code."""
    return _WidthConnection.apply(
        state, folded, static_alpha, static_beta, alpha_scale, beta_scale, eps
    )
