"""megatron-core 0.16.1's attention under ``torch.compile`` (the fused path, ``model.fusions``).

``SelfAttention.forward`` runs its projections and core attention inside
``FineGrainedActivationOffloadingInterface(offload, tensor, name)`` context managers, which do
nothing unless activation offloading is on (t2train never turns it on). Dynamo cannot resume a
graph inside a context manager it does not know, so one graph break in the core attention (a
Triton kernel, run eagerly: ``t2train/kernels/dispatch.py``) sent the whole attention forward
back to eager. With offloading off the context is a ``contextlib.nullcontext``, which dynamo
can break inside; with it on, Megatron's own. Applied when layers are compiled.
"""

from __future__ import annotations

import contextlib

from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
    FineGrainedActivationOffloadingInterface,
)


class _OffloadingWhenOn(FineGrainedActivationOffloadingInterface):
    """Megatron's context when ``offload`` is set, else a ``nullcontext`` of ``tensor``."""

    def __new__(cls, offload: bool, tensor, name: str):
        if offload:
            return FineGrainedActivationOffloadingInterface(offload, tensor, name)
        return contextlib.nullcontext(tensor)


def apply() -> None:
    from megatron.core.transformer import attention

    if attention.off_interface is not FineGrainedActivationOffloadingInterface \
            and attention.off_interface is not _OffloadingWhenOn:
        raise RuntimeError("megatron.core.transformer.attention.off_interface is no longer "
                           "FineGrainedActivationOffloadingInterface: update "
                           "t2train/compat/megatron_compile.py")
    attention.off_interface = _OffloadingWhenOn
