"""Torch-only math shared by the training modules and the exported modeling file.

A module named ``functional.py`` imports nothing but the standard library, torch and other
``functional`` modules: ``t2train export hf`` copies it into the standalone modeling file
(``t2train/residual/hf.py``), so an exported model computes with the very functions the
trainer calls. Fused kernels and memory-saving autograd functions stay beside the training
modules and are checked against these.
"""

from __future__ import annotations

import torch
from torch import Tensor


def at_least_fp32(t: Tensor) -> Tensor:
    """``t`` in fp32, or kept in fp64 (the gradient checks run in fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, weight-free, in (at least) fp32."""
    x = at_least_fp32(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
