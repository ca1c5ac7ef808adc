"""Triton kernel or PyTorch reference, chosen per call.

``T2_KERNELS=triton`` forces the kernels, ``T2_KERNELS=torch`` the references; unset (or
``auto``) means the kernels when every tensor is on CUDA, else the references. Forcing the
kernels on CPU needs the Triton interpreter (``TRITON_INTERPRET=1``, set before Triton is
imported), which is how the tests run them. The kernel modules are imported on first use.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from t2train.residual import attnres as attnres_reference
from t2train.residual import ddl as ddl_reference
from t2train.residual import window_attention as window_reference


def use_triton(*tensors: Tensor) -> bool:
    choice = os.environ.get("T2_KERNELS", "auto")
    on_cuda = all(t.is_cuda for t in tensors)
    if choice == "torch":
        return False
    if choice == "auto":
        return on_cuda
    if choice != "triton":
        raise ValueError(f"T2_KERNELS={choice!r}: choose triton, torch or auto")
    if not on_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError("T2_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1")
    return True


def short_window_attention(q: Tensor, k: Tensor, v: Tensor, window: int,
                           scale: float | None = None) -> Tensor:
    """See ``t2train.residual.window_attention.short_window_attention``."""
    if use_triton(q, k, v):
        from t2train.kernels.window_attention import window_attention

        return window_attention(q, k, v, window, scale)
    return window_reference.short_window_attention(q, k, v, window, scale)


def delta_write(state: Tensor, out: Tensor, beta_logit: Tensor, v_logit: Tensor,
                k_eps: float, v_scale: float) -> Tensor:
    """See ``t2train.residual.ddl.delta_write``."""
    if use_triton(state, out, beta_logit, v_logit):
        from t2train.kernels.ddl_update import delta_write as fused

        return fused(state, out, beta_logit, v_logit, k_eps, v_scale)
    return ddl_reference.delta_write(state, out, beta_logit, v_logit, k_eps, v_scale)


def depth_mix(query: Tensor, sources, partial: Tensor | None, eps: float) -> Tensor:
    """``t2train.residual.attnres.depth_mix`` over the sources and the partial sum (if any)."""
    values = list(sources) + ([] if partial is None else [partial])
    if use_triton(query, *values):
        from t2train.kernels.block_attnres import depth_mix as two_phase

        return two_phase(query, list(sources), partial, eps)
    return attnres_reference.depth_mix(query, values, eps)


def block_phase_1(queries: Tensor, sources, eps: float) -> tuple[Tensor, Tensor]:
    """See ``t2train.residual.attnres.block_phase_1``: S queries over the sources at once."""
    if use_triton(queries, *sources):
        from t2train.kernels.block_attnres import phase_1

        return phase_1(queries, torch.stack(list(sources)), eps)
    return attnres_reference.block_phase_1(queries, list(sources), eps)


def block_phase_2(partial: Tensor, query: Tensor, out: Tensor, lse: Tensor,
                  eps: float) -> Tensor:
    """See ``t2train.residual.attnres.block_phase_2``: one read's merge with the partial sum."""
    if use_triton(partial, query, out, lse):
        from t2train.kernels.block_attnres import phase_2

        return phase_2(partial, query, out, lse, eps)
    return attnres_reference.block_phase_2(partial, query, out, lse, eps)
