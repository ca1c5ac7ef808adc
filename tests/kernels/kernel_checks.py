"""Compare a kernel with its PyTorch reference: outputs and input gradients."""

from __future__ import annotations

import torch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def leaves(*tensors):
    """Fresh leaf copies that require grad (None passes through)."""
    return [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point())
            for t in tensors]


def assert_matches(kernel, reference, inputs, dtype, seed=0):
    """kernel(*inputs) == reference(*fp32 inputs) in value and in every input gradient.

    The reference runs in fp32 on the same (rounded) inputs, so low-precision kernels are
    judged against the exact result; ``dtype`` picks the tolerance.
    """
    ours = leaves(*inputs)
    theirs = leaves(*(None if t is None else t.float() for t in inputs))
    out, expected = kernel(*ours), reference(*theirs)
    torch.manual_seed(seed)
    grad = torch.randn(out.shape, dtype=torch.float32, device=out.device)
    out.backward(grad.to(out.dtype))
    expected.backward(grad)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    for name, a, b in zip(range(len(inputs)), ours, theirs):
        if a is None or (a.grad is None and b.grad is None):  # an input the result ignores
            continue
        torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=tol, rtol=tol,
                                   msg=lambda m, i=name: f"gradient of input {i}: {m}")
