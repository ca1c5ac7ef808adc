"""One optimisation step and one evaluation pass through Megatron's pipeline schedules."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from t2train.engine.interface import MicroBatch, StepResult
from t2train.engine.megatron.numerics import UpdateGuard, grads_not_finite
from t2train.engine.megatron.objects import TrainingObjects
from t2train.engine.shared import data_parallel_sum, model_loss
from t2train.monitor.stragglers import ForwardClock
from t2train.parallel.hops import planned_shape_arguments
from t2train.parallel.init import current_device
from t2train.parallel.traffic import collect_traffic


def _loss(per_token_loss: torch.Tensor):
    loss = per_token_loss.float().mean()
    # clone: the schedule divides the returned loss in place by the micro-batch count
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    """Megatron's forward_step_func: run one micro-batch through one model chunk."""
    return model_loss(model, next(data_iterator)), _loss


def timed_forward_step(clock: ForwardClock, data_iterator, model):
    """``forward_step``, its time counted on ``clock`` (training steps)."""
    with clock.timing():
        return forward_step(data_iterator, model)


def _run_schedule(
    objs: TrainingObjects,
    micro_batches: list[MicroBatch],
    forward_only: bool,
    clock: Optional[ForwardClock] = None,
):
    train, model = objs.config.train, objs.config.model
    for chunk in objs.model:
        chunk.module.start_schedule()
    iterators = [iter(micro_batches) for _ in objs.model]
    hops, config = objs.hops, get_model_config(objs.model[0])
    varying = {}
    if objs.config.parallel.pipeline > 1 and hops.shapes_vary:
        unit = (hops.unit_rows, train.micro_batch_size, model.hidden_size)
        varying = planned_shape_arguments(config, hops, unit, len(micro_batches), forward_only)
    return get_forward_backward_func()(
        forward_step_func=forward_step
        if clock is None
        else functools.partial(timed_forward_step, clock),
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=objs.model,
        num_microbatches=len(micro_batches),
        # A pipeline hop packs the residual state's units along the sequence dim: the
        # layout's largest hop, or each hop's own size when ``varying`` tells the schedule.
        seq_length=model.seq_length * hops.padded_units,
        micro_batch_size=train.micro_batch_size,
        forward_only=forward_only,
        **varying,
    )


def _loss_total(losses_reduced: list[dict]) -> torch.Tensor:
    """(sum, count) of the micro-batch losses over data-parallel replicas, on the device of
    every rank (nothing is read back here)."""
    total = torch.zeros(2, dtype=torch.float64, device=current_device())
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        total[:] = data_parallel_sum([item["lm loss"] for item in losses_reduced])
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            total,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    return total


def _mean_loss(losses_reduced: list[dict]) -> float:
    """Average over micro-batches and data-parallel replicas, known on every rank."""
    loss_sum, count = _loss_total(losses_reduced).tolist()
    return loss_sum / count


def train_step(
    objs: TrainingObjects,
    micro_batches: list[MicroBatch],
    guard: Optional[UpdateGuard] = None,
    clock: Optional[ForwardClock] = None,
) -> StepResult:
    """Forward, backward and (unless ``guard`` says skip) the optimizer update; ``clock``
    counts the time of the forward passes."""
    for chunk in objs.model:
        chunk.train()
        chunk.zero_grad_buffer()
        chunk.module.traffic.reset()
    objs.optimizer.zero_grad()
    total = _loss_total(_run_schedule(objs, micro_batches, forward_only=False, clock=clock))
    # The step's one read from the device: the loss, and whether every gradient is finite
    # (all ranks) when the guard asks.
    read = torch.cat([total, grads_not_finite(objs.model).to(total)]) if guard else total
    loss_sum, count, *not_finite = read.tolist()
    loss = loss_sum / count
    reason = guard.skip_reason(loss, not not_finite[0]) if guard else None
    updated, grad_norm = False, float("nan")  # the norm of an update that did not run
    if reason is None:
        updated, grad_norm, _ = objs.optimizer.step()
        reason = "" if updated else "the optimizer found non-finite gradients"
    if updated:
        objs.scheduler.step(increment=1)
    return StepResult(
        loss=loss,
        read_grad_norm=lambda: _as_float(grad_norm),
        lr=objs.optimizer.param_groups[0]["lr"],
        skipped=not updated,
        read_traffic=collect_traffic(objs.model),
        skip_reason=reason,
    )


def _as_float(grad_norm) -> float:
    """Megatron's norm: a device tensor (``t2train/compat/megatron_optimizer.py``), a float,
    or None (no clipping: 0.0, as Megatron reports it)."""
    return 0.0 if grad_norm is None else float(grad_norm)


@torch.no_grad()
def evaluate(objs: TrainingObjects, batches: list[list[MicroBatch]]) -> float:
    for chunk in objs.model:
        chunk.eval()
    losses = [
        _mean_loss(_run_schedule(objs, micro_batches, forward_only=True))
        for micro_batches in batches
    ]
    for chunk in objs.model:
        chunk.train()
    return sum(losses) / len(losses)
