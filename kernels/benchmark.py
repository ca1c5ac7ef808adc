"""What a kernel benchmark case is: the implementations of one operator at one shape, and
the work a fused pass does there. Each design folder builds its kernels' cases
(``t2train/residual/<design>/benchmarks.py``, ``BENCHMARKS``); ``t2train.bench.kernels``
times them against each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Runtime:
    """Where and how the benchmark runs: CUDA in bf16, or a CPU dry run (Triton interpreter)."""

    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16

    @property
    def on_cuda(self) -> bool:
        return self.device == "cuda"

    def compile(self, fn: Callable) -> Callable:
        # On CPU, inductor would spend minutes in the C++ compiler; dynamo alone still runs.
        # Static shapes: the second shape of the same reference would otherwise recompile it
        # with dynamic shapes (dynamo's automatic dynamic), a slower peer than a user's.
        return (
            torch.compile(fn, dynamic=False) if self.on_cuda else torch.compile(fn, backend="eager")
        )

    def leaf(self, *shape, scale: float = 1.0) -> torch.Tensor:
        """A random input in the run's dtype whose gradient the backward produces."""
        return (torch.randn(*shape, device=self.device, dtype=self.dtype) * scale).requires_grad_()


@dataclass(frozen=True)
class KernelShapes:
    """One micro-batch of a preset's model: its shape, and in ``model`` (the preset's
    ``ModelConfig``) the design options each design's cases run at."""

    label: str
    batch: int
    model: Any

    @property
    def seq(self) -> int:
        return self.model.seq_length

    @property
    def hidden(self) -> int:
        return self.model.hidden_size

    @property
    def heads(self) -> int:
        return self.model.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.model.num_query_groups or self.model.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def describe(self) -> dict:
        return {
            "label": self.label,
            "batch": self.batch,
            "seq": self.seq,
            "hidden": self.hidden,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
        }


@dataclass
class Impl:
    name: str
    run: Callable  # () -> tensor or list of tensors
    inputs: list  # leaves whose gradients the backward produces


@dataclass
class Case:
    kernel: str
    preset: str
    shape: str
    impls: list
    work: dict  # mode -> FLOPs or bytes
    unit: str  # "TFLOP/s" or "GB/s"


def peers(rt: Runtime, kernel, call: Callable, inputs) -> list:
    """A ``Kernel``'s Triton function against its PyTorch reference, eager and compiled:
    ``call(f)`` runs one of them on the case's tensors."""
    compiled = rt.compile(kernel.reference)
    return [
        Impl(name, lambda f=f: call(f), inputs)
        for name, f in (
            ("triton", kernel.triton_function()),
            ("eager", kernel.reference),
            ("torch.compile", compiled),
        )
    ]
