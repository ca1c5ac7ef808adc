"""Helpers shared by the Triton kernels: interpreter detection and exact matrix products."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fp32_dot(dtype: torch.dtype) -> bool:
    """Whether ``dot`` must multiply in fp32 (IEEE, no TF32).

    fp32 inputs: so the kernels match the fp32 reference to ~1e-6. bf16 under the interpreter:
    its bf16 ``tl.dot`` multiplies raw bit patterns (triton-lang/triton#11584).
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


@triton.jit
def dot(a, b, FP32_DOT: tl.constexpr):
    """a @ b accumulated in fp32; in IEEE fp32 when ``FP32_DOT`` (also for operands of two
    dtypes: low-precision activations, fp32 weights). The ``else`` matters: the compiler
    compiles what follows a constant ``if`` that returns, and a mixed-dtype ``tl.dot`` there
    fails to compile."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)
