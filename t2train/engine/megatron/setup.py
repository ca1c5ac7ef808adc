"""Build what one training rank holds: DDP-wrapped model chunks, optimizer, LR schedule."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import get_megatron_optimizer

from t2train.compat import megatron_optimizer
from t2train.config.schema import Config
from t2train.engine.megatron.objects import TrainingObjects
from t2train.engine.shared import lr_scheduler, optimizer_config
from t2train.engine.start_weights import StartWeights
from t2train.model.build import build_model_chunks, transformer_config
from t2train.parallel.hop_plan import plan_hops


def build_training_objects(
    config: Config, vocab_size: int, start_weights: Optional[StartWeights] = None
) -> TrainingObjects:
    """Collective. ``start_weights`` fill the chunks before DDP and the optimizer copy them."""
    tf_config = transformer_config(config)
    hops = plan_hops(config)
    chunks = build_model_chunks(config, tf_config, vocab_size, hops)
    if start_weights is not None:
        start_weights.load_into(chunks, config)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=config.parallel.distributed_optimizer,
    )
    model = [
        DistributedDataParallel(tf_config, ddp_config, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    megatron_optimizer.apply()
    optimizer = get_megatron_optimizer(optimizer_config(config), model)
    fuse_adam(optimizer)
    scheduler = lr_scheduler(optimizer, config)
    _wire_schedule_hooks(tf_config, model, optimizer)
    return TrainingObjects(config, tf_config, model, optimizer, scheduler, vocab_size, hops)


def fuse_adam(optimizer) -> None:
    """The torch AdamW inside Megatron's optimizer (without Apex or TransformerEngine) as one
    fused kernel per step: megatron-core builds it with torch's default, a loop of foreach
    kernels that reads each parameter's step count back from the host. Fused also on the
    CPU, so the tests run the GPU's update."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)


def _wire_schedule_hooks(tf_config, model, optimizer) -> None:
    """What Megatron's pipeline schedules call back into (as in Megatron-LM's training.py)."""
    tf_config.grad_scale_func = optimizer.scale_loss
    tf_config.finalize_model_grads_func = finalize_model_grads
    no_sync = [chunk.no_sync for chunk in model]
    tf_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
