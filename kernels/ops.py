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
# The same for operators made of torch operations only: opaque so that a compiled graph saves
# for their backward what they save, not what the partitioner would keep of their insides (it
# keeps an intermediate that a matmul of the backward reads, such as an fp32 copy of the input).
COMPOSITES: dict[str, Callable] = {}


def _registered(name: str, table: dict) -> Callable:
    def register(fn: Callable):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(fn)
        op.register_fake(fn)
        table[name] = fn
        return op

    return register


def kernel_op(name: str) -> Callable:
    """Decorator: ``fn`` (typed arguments: tensors, lists of tensors, floats, ints, bools) as
    the operator ``torch.ops.t2train.<name>``, with ``fn`` itself as its fake implementation."""
    return _registered(name, IMPLEMENTATIONS)


def composite_op(name: str) -> Callable:
    """``kernel_op`` for a function of torch operations (no kernel of its own)."""
    return _registered(name, COMPOSITES)


def implementation(name: str) -> Callable:
    """The Python function behind the operator ``torch.ops.t2train.<name>``."""
    return IMPLEMENTATIONS.get(name) or COMPOSITES[name]


def tracing(t: Tensor) -> bool:
    """True while the tracer propagates shapes: ``t`` is a fake tensor, with no data to launch
    on, and its sizes may be symbols (so the launch's block sizes are not worked out)."""
    return isinstance(t, FakeTensor)
