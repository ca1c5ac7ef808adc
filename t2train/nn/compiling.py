"""How t2train uses ``torch.compile``: the backend, and compiling modules in place.

The fused hot path (``model.fusions``, ``t2train/model/build.py``) compiles every decoder
layer, as torchtitan compiles each TransformerBlock: the GEMMs stay library calls and
Inductor generates fused kernels for what lies between them (norms, RoPE's concatenations,
SwiGLU, dropout, the residual design's read and write). ``Module.compile`` compiles in place,
so parameter names, state dicts and checkpoints are those of the eager model.

What dynamo makes of a layer (torch 2.14, megatron-core 0.16.1; ``tests/test_fusions.py``
checks the counts): one graph per layer without a graph break for every design, with the
PyTorch references and with the Triton kernels (custom operators, ``t2train/kernels/ops.py``),
once megatron-core's deprecation warning is ignored (below). Layers share their graphs: the
number a model compiles does not grow with its depth (a few where layers differ: hc's first
layer, depth_attn's window until it is full, Block AttnRes' places in a block; AttnRes'
growing sources are one tensor with a dynamic row count, ``residual/attnres/sources.py``).
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Iterable, NamedTuple, TypeVar

import torch

BACKEND_VARIABLE = "T2_COMPILE_BACKEND"
AnyTuple = TypeVar("AnyTuple", bound=NamedTuple)
# Variants one layer may compile to: training, evaluation, a diagnostics pass, the two halves
# of activation recompute.
GRAPHS_PER_LAYER = 5


# Inductor writes out a pointwise result instead of inlining it into its consumer once the
# expression exceeds 30 ops or 8 reads on a GPU (50 and 12 on the CPU). The n-stream writes
# (``residual/unrolled.py``) read the output, the n streams and their weights, a dozen, and
# at the GPU's limits were written in fp32 and read back before their bf16 store:
# ``t2train bench bytes`` counts `hc` at 86.1 units per sublayer with them, 63.0 with these.
INLINE_LIMITS = {"realize_opcount_threshold": 50, "realize_acc_reads_threshold": 12}


def compile_backend() -> str:
    """``inductor`` unless ``T2_COMPILE_BACKEND`` names another (the CPU tests and the GPU
    check's dry run use ``aot_eager``: the same graphs, without generating kernels, which
    costs a minute per graph on a loaded 2-core CPU)."""
    return os.environ.get(BACKEND_VARIABLE, "inductor")


def trace_megatron_modules() -> None:
    """megatron-core 0.16.1's ``RowParallelLinear`` passes ``tp_group=None`` on purpose and
    so calls ``warnings.warn`` (a deprecation) on every forward on rank 0: dynamo cannot trace
    the call with its keyword arguments and breaks the graph there, twice per layer. Inside
    compiled code it is dropped (eager code still warns)."""
    ignored = getattr(torch._dynamo.config, "ignore_logging_functions", None)  # torch >= 2.11
    if ignored is not None:
        ignored.add(warnings.warn)


def inductor_options(design_options: dict | None = None) -> dict:
    """What a layer compiles with: ``INLINE_LIMITS`` and its design's own options."""
    return {**INLINE_LIMITS, **(design_options or {})}


def compile_modules(
    modules: Iterable[torch.nn.Module],
    backend: str | None = None,
    design_options: dict | None = None,
) -> None:
    """Compile each module in place (its first call traces and compiles it); with Inductor,
    with ``inductor_options(design_options)``."""
    modules = list(modules)
    trace_megatron_modules()
    config = torch._dynamo.config
    # Hooks added later (the diagnostics pass's per-layer RMS on the layers' norms) must
    # recompile, not be skipped silently: guard on the hooks (a few checks per call).
    config.skip_nnmodule_hook_guards = False
    config.recompile_limit = max(config.recompile_limit, GRAPHS_PER_LAYER * len(modules))
    # Under selective recompute (t2train/nn/recompute.py) a layer is one checkpointed region:
    # a sublayer's read hands its write values through module attributes (hc's mappings,
    # Block AttnRes' phase-1 rows), set and cleared within the layer. The graph carries those
    # values to the recompute; replaying the assignments there is not needed.
    config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    backend = backend or compile_backend()
    # the other backends take no options
    options = inductor_options(design_options) if backend == "inductor" else None
    for module in modules:
        module.compile(backend=backend, options=options)


def compiled(fn: Callable) -> Callable:
    """``fn`` compiled on first use with ``compile_backend()``."""
    compiled_fn = None

    def call(*args):
        nonlocal compiled_fn
        if compiled_fn is None:
            compiled_fn = torch.compile(fn, backend=compile_backend())
        return compiled_fn(*args)

    return call


def replace_fields(fields: AnyTuple, **changes) -> AnyTuple:
    """A NamedTuple's ``_replace``, for code that runs compiled: torch 2.11's dynamo
    returns the result of a NamedTuple's ``_replace`` from a compiled function as an empty
    tuple (torch 2.14's does not), so the fields are passed to the constructor one by one."""
    unknown = set(changes) - set(fields._fields)
    if unknown:
        raise ValueError(f"{type(fields).__name__} has no field(s) {sorted(unknown)}")
    return type(fields)(*(changes.get(name, value) for name, value in zip(fields._fields, fields)))
