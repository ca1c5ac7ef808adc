"""Triton kernel or PyTorch reference, chosen per call.

``T2_KERNELS=triton`` forces the kernels, ``T2_KERNELS=torch`` the references; unset (or
``auto``) means the kernels when every tensor is on CUDA, else the references. Forcing the
kernels on CPU needs the Triton interpreter (``TRITON_INTERPRET=1``, set before Triton is
imported), which is how the tests run them. The kernel modules are imported on first use.

The residual designs own their PyTorch references (``t2train/residual/``) and ask
``route(kernel, reference, *tensors)`` which one to call: both take the same arguments.
``launches`` counts the calls routed to each kernel, so a caller (the tests) can tell that
the kernels ran rather than the references: ``reset_launches()``, run, read ``launches``.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections import Counter
from typing import Callable

import torch
from torch import Tensor

KERNELS = {  # kernel name -> (module, function)
    "window_attention": ("t2train.kernels.window_attention", "window_attention"),
    "delta_write": ("t2train.kernels.ddl_update", "delta_write"),
    "fp32_linear": ("t2train.kernels.fp32_linear", "fp32_linear"),
    "depth_mix": ("t2train.kernels.depth_mix", "depth_mix"),
    "block_phase_1": ("t2train.kernels.depth_mix", "phase_1"),
    "block_phase_2": ("t2train.kernels.depth_mix", "phase_2"),
    "stream_read": ("t2train.kernels.mhc_streams", "stream_read"),
    "stream_write": ("t2train.kernels.mhc_streams", "stream_write"),
    "hc_read": ("t2train.kernels.mhc_streams", "width_read"),
    "hc_write": ("t2train.kernels.mhc_streams", "depth_write"),
}
launches: Counter = Counter()  # kernel name -> calls routed to the Triton kernel


def reset_launches() -> None:
    launches.clear()


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


def route(kernel: str, reference: Callable, *tensors: Tensor) -> Callable:
    """The Triton kernel ``kernel`` when ``use_triton(*tensors)`` (counted), else ``reference``.

    Inside a compiled layer (``model.fusions``) the kernel runs eagerly, one graph break per
    call: dynamo does not trace into the kernels' autograd functions and launch code."""
    if not use_triton(*tensors):
        return reference
    return functools.partial(_launch, kernel)


@torch.compiler.disable
def _launch(kernel: str, *args, **kwargs):
    module, function = KERNELS[kernel]
    launches[kernel] += 1
    return getattr(importlib.import_module(module), function)(*args, **kwargs)
