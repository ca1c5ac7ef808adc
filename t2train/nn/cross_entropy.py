"""Vocabulary-parallel cross-entropy from the logits as they are, without an fp32 copy of them.

Megatron's ``vocab_parallel_cross_entropy`` casts the [s, b, V/tp] logits to fp32 and keeps
that copy as the softmax for the backward pass: at the 125m preset (16 x 2048 tokens a
micro-batch, 32k vocabulary) a 4.2 GB fp32 tensor, written, then rewritten in place by
about ten elementwise passes forward and backward. Here the same fp32 arithmetic runs inside
two compiled kernels that read the logits in their own dtype: the forward keeps only one
fp32 log-sum-exp per token (and the logits it was given), the backward writes
``softmax - one_hot`` in the logits' dtype in one pass. Across tensor-parallel ranks the
maximum, the sum of exponentials and the target's logit are all-reduced, as Megatron does.
Used on the fused path (``model.fusions``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from t2train.nn.compiling import compiled


def _exp_sum_and_target(
    logits: Tensor, maximum: Tensor, target: Tensor, mine: Tensor
) -> tuple[Tensor, Tensor]:
    """Per token: sum_v exp(z_v - max) over this rank's vocabulary, and z_target (0 where
    the target is another rank's)."""
    exp_sum = (logits.float() - maximum.unsqueeze(-1)).exp().sum(-1)
    picked = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1).float()
    return exp_sum, torch.where(mine, picked, 0.0)


def _logits_grad(
    logits: Tensor, lse: Tensor, target: Tensor, mine: Tensor, grad_loss: Tensor
) -> Tensor:
    """d loss / d z_v = (softmax_v - [v == target]) * d loss, in the logits' dtype."""
    softmax = (logits.float() - lse.unsqueeze(-1)).exp()
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    one_hot = (vocab == target.unsqueeze(-1)) & mine.unsqueeze(-1)
    return ((softmax - one_hot.float()) * grad_loss.unsqueeze(-1)).to(logits.dtype)


_fused_exp_sum_and_target = compiled(_exp_sum_and_target)
_fused_logits_grad = compiled(_logits_grad)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group) -> Tensor:
        size = dist.get_world_size(group) if group is not None else 1
        first = (dist.get_rank(group) if size > 1 else 0) * logits.shape[-1]
        maximum = logits.amax(-1).float()  # exact in any dtype
        if size > 1:
            dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        local = target - first
        mine = (local >= 0) & (local < logits.shape[-1])
        local = torch.where(mine, local, 0)
        exp_sum, target_logit = _fused_exp_sum_and_target(logits, maximum, local, mine)
        if size > 1:
            sums = torch.stack((exp_sum, target_logit))
            dist.all_reduce(sums, group=group)
            exp_sum, target_logit = sums
        lse = maximum + exp_sum.log()
        ctx.save_for_backward(logits, lse, local, mine)
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        logits, lse, local, mine = ctx.saved_tensors
        return _fused_logits_grad(logits, lse, local, mine, grad_loss.contiguous()), None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, group=None) -> Tensor:
    """Per-token loss ``logsumexp(z) - z_target`` (fp32) for logits [..., V/tp] split over the
    ranks of ``group`` (None: one rank) and targets [...] in the whole vocabulary."""
    return _CrossEntropy.apply(logits, target, group)
