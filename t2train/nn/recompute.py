"""Selective activation recompute (``model.recompute=selective``): torchtitan's op-level policy.

Each decoder layer runs inside ``torch.utils.checkpoint`` with a selective-checkpoint context:
the outputs of the GEMMs and of attention are kept for the backward (the work that is costly
to redo), everything else the layer computes (norms, RoPE, SwiGLU's activation, dropout, the
residual design's reads and writes) is recomputed from the layer's input and those outputs.
torchtitan also recomputes every second GEMM; here every GEMM output is kept.

Eagerly, the policy decides per operator call during the forward and serves the kept outputs
again during the recompute. In a compiled layer dynamo traces the checkpoint as one region
of the layer's graph and the policy tags its nodes, which the partitioner follows when it
splits the forward from the backward: the layer stays one graph. Dropout's masks are drawn
again in the recompute from the RNG states of the forward: the default generator's, which the
checkpoint records (``preserve_rng_state``), and those of Megatron's RNG tracker, which
attention dropout forks (replayed here, as Megatron's own checkpoint does for full recompute).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from megatron.core import tensor_parallel
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

aten = torch.ops.aten

# The GEMMs (Megatron's linears are aten.mm), every fused attention PyTorch may dispatch to,
# and tensor parallelism's in-place all-reduce of a sublayer's output (its input is the
# cached GEMM output: redone, it would sum the reduced values again). Sequence parallelism's
# reduce-scatters and all-gathers write into buffers the caller allocates, which a cached
# result would not fill: they are redone eagerly (compiled, dynamo's functional
# reduce-scatter returns its result and is kept, as in torchtitan's policy).
KEPT_OPS = {
    aten.mm.default,
    aten._scaled_mm.default,  # float8 GEMMs (train.precision=fp8)
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.c10d.allreduce_.default,
    torch.ops._c10d_functional.all_reduce.default,  # compiled, dynamo's form of the above
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}
# Custom operators by (namespace, name), not imported here: flash-attn's (CUDA only) and
# t2train's window-attention kernel (the local mixer's and the depth read's attention).
KEPT_CUSTOM_OPS = {("flash_attn", "_flash_attn_forward"), ("t2train", "window_attention")}


def keeps(func) -> bool:
    """Whether the policy keeps ``func``'s outputs for the backward."""
    if func in KEPT_OPS:
        return True
    namespace, name = getattr(func, "namespace", None), getattr(func, "_opname", None)
    return (namespace, name) in KEPT_CUSTOM_OPS


def _policy(_ctx, func, *_args, **_kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if keeps(func) else CheckpointPolicy.PREFER_RECOMPUTE


@contextmanager
def _tracker_states(states: dict) -> Iterator[None]:
    """Megatron's RNG tracker at ``states`` (those of the forward) during a recompute: its
    forks draw the forward's masks and leave the tracker where the backward found it."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    current = tracker.get_states()
    tracker.set_states(dict(states))
    try:
        yield
    finally:
        tracker.set_states(current)


def _contexts():
    """Called by the checkpoint as its forward starts: the policy's contexts, the recompute's
    with the tracker's states as they are now."""
    forward, recompute = create_selective_checkpoint_contexts(
        _policy, allow_cache_entry_mutation=True
    )
    if torch.compiler.is_compiling():
        return forward, recompute
    return forward, _recompute(recompute, tensor_parallel.get_cuda_rng_tracker().get_states())


@contextmanager
def _recompute(cached, states: dict) -> Iterator[None]:
    with _tracker_states(states), cached:
        yield


def selective_checkpoint(function: Callable, *args):
    """``function(*args)`` with the selective policy: what autograd keeps of it is its
    inputs and its GEMMs' and attention's outputs."""
    return checkpoint(function, *args, use_reentrant=False, context_fn=_contexts)
