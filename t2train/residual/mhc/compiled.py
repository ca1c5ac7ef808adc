"""mHC's normed projection for compiled code: RMSNorm(vec x) phi^T as products summed over
the streams, with a hand-written backward for the products.

Autograd of the products writes the streams' gradient, a sum over the n^2 + 2n outputs of
each output's gradient times its row of phi, as an fp32 [n, tokens, h] buffer that the next
pass reads back (a reduction over the outputs: the compiler writes it in its accumulator's
dtype). Here that sum is taken in fp32 over terms rounded to the streams' dtype, as a bf16
GEMM rounds its inputs, and written in that dtype: half the bytes written and read
(``t2train bench bytes``: `mhc` 84.9 -> 76.9 units per sublayer). Each stream's sum is
written out term by term, not as a reduction over the outputs, so that the compiler inlines
it into the pass that adds the state's other gradients (with mHC's ``INDUCTOR_OPTIONS``)
instead of writing it and reading it back: 80.9 -> 72.9. The norm's statistic stays with
autograd, which fuses its gradient into the pass that reads this one.

Forward, each output's product and the norm's statistic are reductions over h that read
all n streams: the compiler computes them in one pass over the streams (as one reduction
over the flattened streams and a reduction per stream they were two): 72.9 -> 69.0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from t2train.nn.functional import at_least_fp32
from t2train.residual.unrolled import weighted_terms


class _Products(torch.autograd.Function):
    """p[..., k] = sum_{j, i} x_j[..., i] phi[k, j i], in fp32; x the streams [n, ..., h].

    dx_j = sum_k dp_k phi[k, j]      dphi[k, j] = sum_tokens dp_k x_j
    """

    @staticmethod
    def forward(ctx, state: Tensor, projection: Tensor) -> Tensor:
        ctx.save_for_backward(state, projection)
        rows = _rows(projection, state)
        streams = [at_least_fp32(s) for s in state.unbind(0)]
        # one reduction over h per output, each reading all n streams, so that the compiler
        # computes them and the norm's statistic in one pass over the streams
        return torch.cat(
            [weighted_terms(streams, list(row)).sum(-1, keepdim=True) for row in rows], -1
        )

    @staticmethod
    def backward(ctx, grad: Tensor):
        state, projection = ctx.saved_tensors
        rows = _rows(projection, state)  # [outputs, n, h]
        grad_state = torch.stack(
            [_stream_gradient(grad, rows[:, j], state.dtype) for j in range(rows.shape[1])]
        )
        tokens = list(range(state.dim() - 2))
        grad_rows = (grad[..., :, None, None] * _by_token(state)).sum(tokens)
        return grad_state, grad_rows.reshape(projection.shape).to(projection.dtype)


def _stream_gradient(grad: Tensor, rows: Tensor, dtype: torch.dtype) -> Tensor:
    """dx_j = sum_k dp_k phi[k, j] ([..., outputs] and [outputs, h]) term by term, each term
    rounded to ``dtype`` as a bf16 GEMM rounds its inputs, summed in at least fp32."""
    terms = [at_least_fp32((grad[..., k : k + 1] * rows[k]).to(dtype)) for k in range(len(rows))]
    return sum(terms[1:], terms[0]).to(dtype)


def _by_token(state: Tensor) -> Tensor:
    """[n, ..., h] -> [..., 1, n, h]: a token's streams, against each output's row."""
    return state.movedim(0, -2).unsqueeze(-3)


def _rows(projection: Tensor, state: Tensor) -> Tensor:
    """phi [outputs, n h] as [outputs, n, h], in fp32."""
    return at_least_fp32(projection).view(-1, state.shape[0], state.shape[-1])


def flat_rms_projection_fused(state: Tensor, projection: Tensor, eps: float) -> Tensor:
    """``flat_rms_projection`` for compiled code (see the module's docstring)."""
    with torch.autocast(state.device.type, enabled=False):
        streams = [at_least_fp32(s) for s in state.unbind(0)]
        squares = weighted_terms(streams, streams).sum(-1)
        inv_rms = torch.rsqrt(squares / (state.shape[0] * state.shape[-1]) + eps)
        return _Products.apply(state, projection) * inv_rms.unsqueeze(-1)
