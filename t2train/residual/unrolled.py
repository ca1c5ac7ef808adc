"""The n-stream read and write of static `hc` as the compiler fuses them: sums over the n
streams written out term by term (n is a few), so each is pointwise over [..., h] and
Inductor fuses it into the pass that reads or writes the streams anyway.

The read fuses into the pass of the norm that follows (which writes only the normed input;
the read's result is recomputed from the streams in the backward, not saved). Static
`hc`'s write (``stream_write_fused``; dynamic `hc` writes with the next read,
``hc/compiled.py``) is PyTorch with a hand-written backward, its sums over the streams
written over the stacked [n, ..., h] state (one weight per stream broadcast over h): one
pass over the new streams' gradient and the output, with the mixing weights' gradients as
row reductions, and a streams' gradient the compiler computes inside the pass that writes
the read's rather than writing it (autograd of the same sums writes fp32 [n, tokens, h]
buffers). Dynamic `hc` and `mhc` write with the next read (``hc/compiled.py``,
``mhc/compiled.py``) and take the helpers below.

As the Triton kernels' custom operators (``kernels/stream_mix.py``) the read and the write
are fusion barriers: each writes its result for the next pass to read again. An ``einsum``
over the streams would be a batched GEMM on fp32 copies of them. Eagerly the terms would each
be written: eager code keeps the kernels (or the references). ``t2train bench bytes`` counts
the difference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from t2train.nn.functional import at_least_fp32


def weighted_sum(state: Tensor, weights: Tensor) -> Tensor:
    """sum_i weights[..., i] h_i in fp32; state [n, ..., h], weights [..., n] (fp32)."""
    streams = [at_least_fp32(state[i]) for i in range(state.shape[0])]
    return weighted_terms(streams, [weights[..., i, None] for i in range(len(streams))])


def weighted_terms(tensors, weights) -> Tensor:
    """sum_k weights[k] tensors[k], one term after another (pointwise: the compiler fuses
    it into the pass that reads the tensors)."""
    total = weights[0] * tensors[0]
    for weight, tensor in zip(weights[1:], tensors[1:]):
        total = total + weight * tensor
    return total


class _StreamWrite(torch.autograd.Function):
    """h'_j = sum_i R[..., i, j] h_i + b[..., j] out; with g_j = dL/dh'_j:

    dh_i = sum_j R[i, j] g_j      dout = sum_j b_j g_j
    dR[i, j] = h_i^T g_j          db_j = out^T g_j
    """

    @staticmethod
    def forward(ctx, state, residual, beta, out):
        ctx.save_for_backward(state, residual, beta, out)
        streams = state.unbind(0)
        n = len(streams)
        # bf16 times fp32 is computed in fp32 (no explicit upcast: see the backward)
        new = weighted_terms(
            [out, *streams],
            [per_stream(beta), *(per_stream(residual[..., i, :]) for i in range(n))],
        )
        return new.to(state.dtype)

    @staticmethod
    def backward(ctx, grad):
        state, residual, beta, out = ctx.saved_tensors
        streams, grads = state.unbind(0), grad.unbind(0)
        n = len(streams)
        # No explicit upcast of a saved bf16 tensor: the partitioner would share it with the
        # forward's and save the fp32 copy.
        grad_out = weighted_terms(grads, [beta[..., j, None] for j in range(n)])
        grad_state = weighted_terms(grads, [per_stream(residual[..., :, j]) for j in range(n)])
        grad_residual = torch.stack([(state * g).sum(-1) for g in grads], -1).movedim(0, -2)
        grad_beta = torch.stack([(out * g).sum(-1) for g in grads], -1)
        return (
            grad_state.to(state.dtype),
            grad_residual.to(residual.dtype),
            grad_beta.to(beta.dtype),
            grad_out.to(out.dtype),
        )


def per_stream(weights: Tensor) -> Tensor:
    """[..., n] -> [n, ..., 1]: one weight per stream and token, broadcast over h."""
    return weights.movedim(-1, 0)[..., None]


def stream_write_fused(state: Tensor, residual: Tensor, beta: Tensor, out: Tensor) -> Tensor:
    """h'_j = sum_i residual[..., i, j] h_i + beta[..., j] out for compiled code: state
    [n, ..., h], residual [..., n, n] and beta [..., n] in fp32, out [..., h]; the new
    streams in the state's dtype."""
    return _StreamWrite.apply(state, residual, beta, out)
