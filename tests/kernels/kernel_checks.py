"""Compare a kernel with its PyTorch reference: outputs and input gradients, and prove the
kernel ran (the dispatch counter, and its autograd node in the result's graph)."""

from __future__ import annotations

import os
from unittest import mock

import torch

from t2train.kernels import dispatch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# kernel name in the dispatch counter -> the custom operators (torch.ops.t2train.*) whose
# backward nodes its forward leaves in the graph
KERNEL_OPS = {
    "window_attention": {"window_attention"},
    "delta_write": {"delta_write"},
    "fp32_linear": {"fp32_linear"},
    "depth_mix": {"block_phase_1", "block_phase_2"},
    "block_phase_1": {"block_phase_1"},
    "block_phase_2": {"block_phase_2"},
    "stream_read": {"stream_read"},
    "stream_write": {"stream_write"},
    "mhc_write_mappings": {"stream_mappings"},
    "hc_read": {"stream_read"},
    "hc_write": {"stream_write"},
    "hc_connect_backward": {"stream_connect_backward"},  # a backward: none of its own
    "mhc_connect_backward": {"flat_stream_connect_backward"},  # likewise
}
# kernel name -> the autograd functions around its operators (calling their backward
# operator themselves), whose nodes stand in the graph for the operators'
KERNEL_FUNCTIONS = {
    "block_phase_1": {"_HandingOnBackward"},
    "block_phase_2": {"_PartialHandedOnBackward"},
    "hc_connect_backward": {"_ConnectBackward"},
    "mhc_connect_backward": {"_ConnectBackward"},
}
BACKWARD_NODES = {
    kernel: {f"GeneratedBackwardFor_t2train_{op}_defaultBackward" for op in ops}
    | KERNEL_FUNCTIONS.get(kernel, set())
    for kernel, ops in KERNEL_OPS.items()
}


def leaves(*tensors):
    """Fresh leaf copies that require grad (None passes through)."""
    return [
        None if t is None else t.detach().clone().requires_grad_(t.is_floating_point())
        for t in tensors
    ]


def graph_nodes(tensor: torch.Tensor) -> set[str]:
    """Names of the autograd nodes ``tensor``'s backward would run."""
    seen, todo, names = set(), [tensor.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def run_kernels(fn, *args, **kwargs):
    """``fn`` with ``T2_KERNELS=triton``, the dispatch counter reset first."""
    dispatch.reset_launches()
    with mock.patch.dict(os.environ, {"T2_KERNELS": "triton"}):
        return fn(*args, **kwargs)


def assert_kernel_ran(out: torch.Tensor, name: str, calls: int = 1) -> None:
    """The dispatch routed ``calls`` calls to kernel ``name`` and to nothing else, and the
    result's backward runs the kernel's backward."""
    assert dict(dispatch.launches) == {name: calls}, dict(dispatch.launches)
    assert graph_nodes(out) & BACKWARD_NODES[name], f"{name}'s backward is not in the graph"


def assert_matches(kernel, reference, inputs, dtype, name, seed=0):
    """kernel(*inputs) == reference(*fp32 inputs) in value and in every input gradient;
    ``kernel`` calls the dispatch, which must route it to the Triton kernel ``name``.

    The reference runs in fp32 on the same (rounded) inputs and upstream gradient, so
    low-precision kernels are judged against the exact result; ``dtype`` picks the tolerance.
    """
    ours = leaves(*inputs)
    theirs = leaves(*(None if t is None else t.float() for t in inputs))
    out = run_kernels(kernel, *ours)
    assert_kernel_ran(out, name)
    expected = reference(*theirs)
    torch.manual_seed(seed)
    # One upstream gradient for both, rounded to the kernel's dtype like its inputs: with the
    # exact one the reference's gradients move by that rounding, amplified where they cancel
    # (a softmax's weights' gradients sum to zero), which is not the kernel's error.
    grad = torch.randn(out.shape, dtype=torch.float32, device=out.device).to(out.dtype)
    out.backward(grad)
    expected.backward(grad.float())
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    for index, a, b in zip(range(len(inputs)), ours, theirs):
        if a is None or (a.grad is None and b.grad is None):  # an input the result ignores
            continue
        torch.testing.assert_close(
            a.grad.float(),
            b.grad.float(),
            atol=tol,
            rtol=tol,
            msg=lambda m, i=index: f"gradient of input {i}: {m}",
        )
