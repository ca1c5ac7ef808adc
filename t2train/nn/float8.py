"""float8 GEMMs for the attention and the MLP (``train.precision=fp8``): torchao's float8
training on Megatron's tensor-parallel linears.

torchao's entry point, ``convert_to_float8_training``, swaps ``torch.nn.Linear`` modules for
its ``Float8Linear``; Megatron's ``ColumnParallelLinear`` and ``RowParallelLinear`` are not
``nn.Linear`` (their forward wraps the matmul in tensor-parallel communication), so no module
filter ever sees them, while a design's own ``nn.Linear`` gates (ddl's) would be converted.
Megatron's linears hand the matmul and its communication to ``_forward_impl``; the
subclasses here override only that, with torchao's float8 matmul (the autograd function
``Float8Linear.forward`` calls) behind the communication Megatron's autograd function does:
the input all-gathered under sequence parallelism (its gradient reduce-scattered), else its
gradient all-reduced over the tensor-parallel ranks. Parameters, their names, init, sharded
state dict and the output's dtype stay Megatron's: weights stay in high precision (the
float8 copies live for one GEMM), so checkpoints are those of a bf16 run. Unlike Megatron's
function, which keeps this rank's part of a sequence-parallel input and gathers it again for
the weight gradient, torchao's keeps the gathered input for the backward (more activation
memory under sequence parallelism), and nothing overlaps the communication with the GEMMs.

``convert_to_float8`` changes the class of the four linears of every Megatron
``SelfAttention`` (the local mixer's too) and ``MLP`` in place, after the model is built and
before it is compiled; the embedding, the output layer, the norms and every projection of the
residual designs keep their precision.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from torch import Tensor
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
from torchao.float8.float8_training_tensor import LinearMMConfig

from t2train.errors import require

# torch._scaled_mm: the GEMMs' inner and output dimensions must be multiples of this.
ALIGNMENT = 16
# The compute capability of the first GPUs with FP8 tensor cores (Ada, then Hopper).
FP8_CAPABILITY = (8, 9)


class Float8Gemm(NamedTuple):
    """What torchao's float8 matmul needs besides its operands: the recipe's casts and the
    three GEMMs' settings (output, input gradient, weight gradient)."""

    config: Float8LinearConfig
    mm_config: LinearMMConfig


def float8_gemm(config: Float8LinearConfig) -> Float8Gemm:
    """The settings of torchao's ``Float8Linear`` for ``config``, taken from one made through
    the public entry point (which also applies torchao's workaround for Triton's float8
    stores in compiled kernels)."""
    template = convert_to_float8_training(
        torch.nn.Linear(ALIGNMENT, ALIGNMENT, bias=False, device="meta"), config=config
    )
    return Float8Gemm(template.config, template.linear_mm_config)


def recipe_config(recipe: str) -> Float8LinearConfig:
    """torchao's recipe by name: ``tensorwise`` or ``rowwise`` (``train.fp8_recipe``)."""
    return Float8LinearConfig.from_recipe_name(recipe)


class _Float8Matmul:
    """Megatron's linear with its matmul in float8 (mixed in before the Megatron class)."""

    float8: Float8Gemm

    def _forward_impl(
        self,
        input: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        tp_group,
        **_,  # Apex's wgrad fusion and the output layer's deferred wgrad: never on here
    ) -> Tensor:
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, group=tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        gemm = self.float8
        output = matmul_with_hp_or_float8_args.apply(input, weight.t(), gemm.mm_config, gemm.config)
        return output if bias is None else output + bias


class Float8ColumnParallelLinear(_Float8Matmul, ColumnParallelLinear):
    pass


class Float8RowParallelLinear(_Float8Matmul, RowParallelLinear):
    pass


FLOAT8_CLASSES: dict[type, type[torch.nn.Module]] = {
    ColumnParallelLinear: Float8ColumnParallelLinear,
    RowParallelLinear: Float8RowParallelLinear,
}


def sublayer_gemms(
    model: torch.nn.Module,
) -> Iterator[tuple[str, ColumnParallelLinear | RowParallelLinear]]:
    """(name, module) of the attention's and the MLP's projections in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, SelfAttention):
            children = ("linear_qkv", "linear_proj")
        elif isinstance(module, MLP):
            children = ("linear_fc1", "linear_fc2")
        else:
            continue
        for child in children:
            yield f"{name}.{child}", getattr(module, child)


def convert_to_float8(model: torch.nn.Module, config: Float8LinearConfig) -> list[str]:
    """Run the attention's and the MLP's GEMMs of ``model`` in float8 as ``config`` says;
    returns the names of the converted linears."""
    gemm = float8_gemm(config)
    names = []
    for name, linear in sublayer_gemms(model):
        rows, columns = linear.weight.shape
        require(
            rows % ALIGNMENT == 0 and columns % ALIGNMENT == 0,
            "train.precision",
            "fp8",
            f"{name} is {rows} x {columns} on each tensor-parallel rank; float8 GEMMs need "
            f"both dimensions multiples of {ALIGNMENT} (torch._scaled_mm)",
        )
        # In place: the module keeps its parameters, hooks and place in the model.
        linear.__class__ = FLOAT8_CLASSES[type(linear)]
        setattr(linear, "float8", gemm)
        names.append(name)
    return names


def require_fp8_device() -> None:
    """Refuse ``train.precision=fp8`` on a machine whose GPU has no FP8 tensor cores (or that
    has no GPU): torch._scaled_mm needs CUDA compute capability 8.9 or newer."""
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        here = (
            f"{torch.cuda.get_device_name()} (compute capability {capability[0]}.{capability[1]})"
        )
    else:
        capability, here = (0, 0), "no CUDA device"
    require(
        capability >= FP8_CAPABILITY,
        "train.precision",
        "fp8",
        "needs a GPU with FP8 (compute capability 8.9+, H100/H200/L40S/RTX 4090); "
        f"this machine has {here}",
    )
