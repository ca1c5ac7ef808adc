"""The Megatron engine's checkpoints: ``dist_checkpointing`` (torch_dist) of every chunk.

A checkpoint holds the model, the optimizer (fully reshardable), the LR schedule, every
rank's RNG streams and the ``train_state`` the trainer passes (step, tokens, data loader
state, resolved config, code version), published atomically (``t2train/checkpoint/store.py``).
With an ``AsyncCallsQueue`` the shards are written by a forked process (a copy-on-write
snapshot of the state) while training goes on, and the publication runs when the queue
finalizes the save.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject

from t2train.checkpoint.compatibility import check_same_model, check_shard_files
from t2train.checkpoint.integrity import check_finite, optimizer_tensors, recorded_checksums
from t2train.checkpoint.paths import INCOMPLETE, step_dir_name
from t2train.checkpoint.store import (
    capture_rng,
    check_engine,
    current_layout,
    publish_checkpoint,
    read_checkpoint,
    restore_rng,
)
from t2train.compat.megatron_writer import results_in_process, start_results_queue
from t2train.engine.megatron.objects import TrainingObjects
from t2train.processes import die_with_parent

# Reshardable optimizer state so a checkpoint loads into another (TP, PP, DP) layout.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _chunk_keys(chunks: int) -> list[str]:
    return ["model"] if chunks == 1 else [f"model{i}" for i in range(chunks)]


def _model_state(objs: TrainingObjects) -> dict:
    """Sharded state of the unwrapped chunks (keys independent of the DDP wrapper)."""
    return {
        key: chunk.module.sharded_state_dict()
        for key, chunk in zip(_chunk_keys(len(objs.model)), objs.model)
    }


def rng_sharded_object(state: Optional[list]) -> ShardedObject:
    """This rank's RNG streams, one object per (pp, tp, dp) position."""
    layout = current_layout()
    return ShardedObject(
        "rng_state",
        state,
        (layout["pp"], layout["tp"], layout["dp"]),
        (
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(),
        ),
        replica_id=0,
    )


def _has_optimizer_state(optimizer) -> bool:
    """Adam's moments exist only after the first update; before it there is nothing to save."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(len(state) for part in parts for state in part.optimizer.state.values())


def _state_tensors(objs: TrainingObjects) -> list[tuple[str, torch.Tensor]]:
    """This rank's parameters and optimizer state (main parameters and moments)."""
    tensors = [
        (f"{key}.{name}", param)
        for key, chunk in zip(_chunk_keys(len(objs.model)), objs.model)
        for name, param in chunk.module.named_parameters()
    ]
    for part in getattr(objs.optimizer, "chained_optimizers", [objs.optimizer]):
        tensors += optimizer_tensors(part.optimizer)
    return tensors


def save_checkpoint(
    root: Path,
    step: int,
    objs: TrainingObjects,
    train_state: dict,
    async_queue=None,
    on_published: Optional[Callable[[Path], None]] = None,
) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory it publishes.

    Without ``async_queue`` it returns once the checkpoint is published. With one (Megatron's
    ``AsyncCallsQueue``) it returns once the shards' writer has started; the checkpoint is
    published when the queue finalizes the save. ``on_published(path)`` then runs on every rank.
    A state holding NaN or inf raises ``NonFiniteState`` on every rank before anything is
    written.
    """
    check_finite(_state_tensors(objs), "parameters and optimizer state")
    final = root / step_dir_name(step)
    staging = root / (step_dir_name(step) + INCOMPLETE)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    dist.barrier()

    state = _model_state(objs)
    has_optimizer = _has_optimizer_state(objs.optimizer)
    if has_optimizer:
        state["optimizer"] = objs.optimizer.sharded_state_dict(state, metadata=_OPTIMIZER_METADATA)
    state["scheduler"] = objs.scheduler.state_dict()
    state["train_state"] = dict(
        train_state,
        step=step,
        layout=current_layout(),
        has_optimizer=has_optimizer,
        **recorded_checksums(),
    )
    state["rng_state"] = rng_sharded_object(capture_rng())

    def publish() -> None:
        publish_checkpoint(root, staging, final, on_published)

    if async_queue is None:
        with results_in_process():
            dist_checkpointing.save(state, str(staging))
        publish()
    else:
        start_results_queue(die_with_parent)  # its server dies with this trainer
        request = dist_checkpointing.save(state, str(staging), async_sharded_save=True)
        request.add_finalize_fn(publish)
        async_queue.schedule_async_request(request)
    return final


def load_checkpoint(path: Path, objs: TrainingObjects, config=None) -> dict:
    """Collective: load model, optimizer, schedule and (same layout) RNG; returns train state.

    With the run's ``config``, a checkpoint of another model shape or residual design is
    refused naming the field; a missing shard file is named before anything is loaded.
    """
    check_engine(path, "megatron")
    common = read_checkpoint(path, lambda: dist_checkpointing.load_common_state_dict(str(path)))
    if config is not None:
        check_same_model(path, common["train_state"], config.model)
    check_shard_files(path)
    saved_layout = common["train_state"]["layout"]
    same_layout = saved_layout == current_layout()

    state = _model_state(objs)
    has_optimizer = common["train_state"]["has_optimizer"]
    if has_optimizer:
        state["optimizer"] = objs.optimizer.sharded_state_dict(
            state, is_loading=True, metadata=_OPTIMIZER_METADATA
        )
    if same_layout:
        state["rng_state"] = rng_sharded_object(None)
    loaded = read_checkpoint(path, lambda: dist_checkpointing.load(state, str(path)))

    for key, chunk in zip(_chunk_keys(len(objs.model)), objs.model):
        chunk.module.load_state_dict(loaded[key])
    if has_optimizer:
        objs.optimizer.load_state_dict(loaded["optimizer"])
    objs.scheduler.load_state_dict(common["scheduler"])
    if same_layout:
        restore_rng(loaded["rng_state"])
    elif dist.get_rank() == 0:
        warnings.warn(
            f"checkpoint layout {saved_layout} differs from {current_layout()}: "
            "RNG streams start fresh",
            stacklevel=2,
        )
    return common["train_state"]


def read_weights(path: Path, train_state: dict, chunks: list) -> list[dict]:
    """Collective: each bare chunk's weights from a checkpoint of any layout, resharded for
    this rank by dist-checkpointing (``t2train.engine.start_weights``)."""
    check_shard_files(path)
    keys = _chunk_keys(len(chunks))
    wanted = {key: chunk.sharded_state_dict() for key, chunk in zip(keys, chunks)}
    loaded = read_checkpoint(path, lambda: dist_checkpointing.load(wanted, str(path)))
    return [loaded[key] for key in keys]
