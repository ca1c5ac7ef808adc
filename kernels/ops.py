"""The Triton kernels as PyTorch custom operators (``torch.ops.t2train.*``).

``torch.compile`` cannot trace a Triton launch or an ``autograd.Function`` that makes one:
each was a graph break, and a kernel called from inside Megatron's attention split a layer
into eight graphs. As custom operators the kernels are opaque calls inside one graph: dynamo
and AOTAutograd see each operator's output shapes (its fake implementation) and its backward
(another operator), and Inductor fuses what lies around them.

A kernel's forward and backward are each a function that allocates its outputs with torch
operations, returns them at once while ``tracing`` (fake tensors have shapes, not data), and
otherwise launches its Triton kernels into them. ``kernel_op`` registers such a function as
an operator and as its own fake implementation, so the outputs the tracer sees are allocated
by the code that allocates the real ones. ``register_autograd`` then ties the forward to its
backward operator.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

NAMESPACE = "t2train"
# operator name -> its Python implementation (what an operator-counting dispatch mode runs to
# see the operations a kernel makes around its launches)
IMPLEMENTATIONS: dict[str, Callable] = {}


def kernel_op(name: str) -> Callable:
    """Decorator: ``fn`` (typed arguments: tensors, lists of tensors, floats, ints, bools) as
    the operator ``torch.ops.t2train.<name>``, with ``fn`` itself as its fake implementation."""

    def register(fn: Callable):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(fn)
        op.register_fake(fn)
        IMPLEMENTATIONS[name] = fn
        return op

    return register


def tracing(t: Tensor) -> bool:
    """True while the tracer propagates shapes: ``t`` is a fake tensor, with no data to launch
    on, and its sizes may be symbols (so the launch's block sizes are not worked out)."""
    return isinstance(t, FakeTensor)
