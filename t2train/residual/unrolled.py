"""The n-stream read of `hc` and `mhc` as the compiler fuses it: the sum over the n streams
written out term by term (n is a few), so it is pointwise over [..., h] and Inductor fuses it
into the pass of the norm that follows (which writes only the normed input; the read's
result is recomputed from the streams in the backward, not saved).

As the Triton kernel's custom operator (``kernels/stream_mix.py``) the read is a fusion
barrier: it writes its result for the norm to read again. An ``einsum`` over the streams
would be a batched GEMM on fp32 copies of them. Eagerly the terms would each be written:
eager code keeps the kernel (or the reference). ``t2train bench bytes`` counts the
difference.
"""

from __future__ import annotations

from torch import Tensor

from t2train.nn.functional import at_least_fp32


def weighted_sum(state: Tensor, weights: Tensor) -> Tensor:
    """sum_i weights[..., i] h_i in fp32; state [n, ..., h], weights [..., n] (fp32)."""
    total = weights[..., 0, None] * at_least_fp32(state[0])
    for i in range(1, state.shape[0]):
        total = total + weights[..., i, None] * at_least_fp32(state[i])
    return total
