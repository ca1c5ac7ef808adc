"""Triton kernel or PyTorch reference, chosen per call.

``T2_KERNELS=triton`` forces the kernels, ``T2_KERNELS=torch`` the references; unset (or
``auto``) means the kernels when every tensor is on CUDA, else the references. Forcing the
kernels on CPU needs the Triton interpreter (``TRITON_INTERPRET=1``, set before Triton is
imported), which is how the tests run them. The kernel modules are imported on first use.

Each kernel is declared once, as a ``Kernel`` beside its PyTorch reference (the design that
owns the math in ``t2train/residual/``, or ``t2train.nn.precision``): its name, where its
Triton implementation is, and the reference, which takes the same arguments. The residual
package lists them all (``t2train.residual.kernel_table()``, which the tests and the
benchmark read), so this module, below the designs, never names one. A caller asks
``route(kernel, *tensors)`` which of the two to call. ``launches`` counts the calls routed to
each kernel outside compiled code, so a caller (the tests) can tell that the kernels ran
rather than the references: ``reset_launches()``, run, read ``launches``.

The Triton functions call the kernels as custom operators (``t2train/kernels/ops.py``), so a
compiled layer traces through them without a graph break. Their modules (which register the
operators) are imported once, outside traced code: by ``load_kernels`` before a model is
compiled, or at the first eager call.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class Kernel:
    """A fused Triton kernel and the PyTorch reference it equals (same arguments, same result)."""

    name: str  # the launch counter's key, the benchmark's and the tests' name for it
    triton: str  # "t2train.kernels.<module>:<function>", imported on first use
    reference: Callable

    def triton_function(self) -> Callable:
        function = _loaded.get(self.name)
        if function is None:
            module, _, attribute = self.triton.partition(":")
            function = _loaded[self.name] = getattr(importlib.import_module(module), attribute)
        return function


launches: Counter = Counter()  # kernel name -> calls routed to the Triton kernel
_loaded: dict[str, Callable] = {}  # kernel name -> its Triton function, imported


def kernels_wanted() -> bool:
    """Whether a model built now may route to the kernels: forced, or CUDA with ``auto``."""
    choice = os.environ.get("T2_KERNELS", "auto")
    return choice == "triton" or (choice == "auto" and torch.cuda.is_available())


def load_kernels(kernels) -> None:
    """Import the Triton functions of ``kernels`` (and register their operators) now, so that
    compiled code finds them loaded; nothing when the kernels cannot be routed to."""
    if kernels_wanted():
        for kernel in kernels:
            kernel.triton_function()


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


def route(kernel: Kernel, *tensors: Tensor) -> Callable:
    """``kernel``'s Triton function when ``use_triton(*tensors)`` (counted), else its reference.

    Inside a compiled layer (``model.fusions``) the Triton function is traced like the
    reference: its kernels are custom operators in the layer's graph."""
    if not use_triton(*tensors):
        return kernel.reference
    return functools.partial(_launch, kernel)


def _launch(kernel: Kernel, *args, **kwargs):
    if not torch.compiler.is_compiling():
        launches[kernel.name] += 1
    return kernel.triton_function()(*args, **kwargs)
