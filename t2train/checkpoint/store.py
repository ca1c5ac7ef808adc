"""Checkpoints on disk: Megatron ``dist_checkpointing`` (torch_dist) published atomically.

A checkpoint holds the model, the optimizer (fully reshardable), the LR schedule, every
rank's RNG streams and the ``train_state`` the trainer passes (step, tokens, data loader
state, resolved config, code version). Every rank writes its shards into
``step_N.incomplete/`` (``paths.py``); once all are done, rank 0 renames it to ``step_N/``
and then replaces ``latest``. A crash at any point leaves the previous checkpoint and marker
intact. With an ``AsyncCallsQueue`` the shards are written by a forked process (a
copy-on-write snapshot of the state) while training goes on, and the publication runs when
the queue finalizes the save.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject

from t2train.checkpoint.compatibility import check_same_model, check_shard_files
from t2train.checkpoint.errors import CheckpointError
from t2train.checkpoint.paths import (ENGINE_FILE, INCOMPLETE, LATEST, checkpoint_engine,
                                      complete_steps, is_complete, step_dir_name)
from t2train.train.setup import TrainingObjects

# Reshardable optimizer state so a checkpoint loads into another (TP, PP, DP) layout.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _model_keys(objs: TrainingObjects) -> list[str]:
    return ["model"] if len(objs.model) == 1 else [f"model{i}" for i in range(len(objs.model))]


def _model_state(objs: TrainingObjects) -> dict:
    """Sharded state of the unwrapped chunks (keys independent of the DDP wrapper)."""
    return {key: chunk.module.sharded_state_dict()
            for key, chunk in zip(_model_keys(objs), objs.model)}


def current_layout() -> dict:
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size()}


def _rng_object(state: Optional[list]) -> ShardedObject:
    """This rank's RNG streams, one object per (pp, tp, dp) position."""
    layout = current_layout()
    return ShardedObject(
        "rng_state", state, (layout["pp"], layout["tp"], layout["dp"]),
        (parallel_state.get_pipeline_model_parallel_rank(),
         parallel_state.get_tensor_model_parallel_rank(),
         parallel_state.get_data_parallel_rank()), replica_id=0)


def _has_optimizer_state(optimizer) -> bool:
    """Adam's moments exist only after the first update; before it there is nothing to save."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(len(state) for part in parts for state in part.optimizer.state.values())


def capture_rng() -> list:
    from megatron.core import tensor_parallel

    return [{"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}]


def restore_rng(states: list) -> None:
    from megatron.core import tensor_parallel

    state = states[0]
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(root: Path, step: int, objs: TrainingObjects, train_state: dict,
                    async_queue=None, on_published: Optional[Callable[[Path], None]] = None
                    ) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory it publishes.

    Without ``async_queue`` it returns once the checkpoint is published. With one (Megatron's
    ``AsyncCallsQueue``) it returns once the shards' writer has started; the checkpoint is
    published when the queue finalizes the save. ``on_published(path)`` then runs on every rank.
    """
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
        state["optimizer"] = objs.optimizer.sharded_state_dict(state,
                                                               metadata=_OPTIMIZER_METADATA)
    state["scheduler"] = objs.scheduler.state_dict()
    state["train_state"] = dict(train_state, step=step, layout=current_layout(),
                                has_optimizer=has_optimizer)
    state["rng_state"] = _rng_object(capture_rng())

    def publish() -> None:
        publish_checkpoint(root, staging, final, on_published)

    if async_queue is None:
        dist_checkpointing.save(state, str(staging))
        publish()
    else:
        request = dist_checkpointing.save(state, str(staging), async_sharded_save=True)
        request.add_finalize_fn(publish)
        async_queue.schedule_async_request(request)
    return final


def publish_checkpoint(root: Path, staging: Path, final: Path,
             on_published: Optional[Callable[[Path], None]]) -> None:
    """Collective: rename the finished staging directory and point ``latest`` at it."""
    dist.barrier()
    if dist.get_rank() == 0:
        replaced = final.with_name(final.name + ".replaced")
        if final.exists():  # re-saving the same step after a resume: moved aside, not lost
            os.replace(final, replaced)
        os.replace(staging, final)
        shutil.rmtree(replaced, ignore_errors=True)
        marker = root / (LATEST + ".tmp")
        marker.write_text(final.name + "\n")
        os.replace(marker, root / LATEST)
    dist.barrier()
    if on_published is not None:
        on_published(final)


def find_latest(root: Path) -> Optional[Path]:
    """The newest complete checkpoint under ``root``; half-written ones are skipped."""
    if not root.is_dir():
        return None
    for leftover in sorted(root.glob("*" + INCOMPLETE)):
        warnings.warn(f"ignoring incomplete checkpoint {leftover} (a save was interrupted)")
    marker = root / LATEST
    if marker.is_file():
        named = root / marker.read_text().strip()
        if is_complete(named):
            return named
        warnings.warn(f"{marker} names {named.name}, which is not a complete checkpoint")
    steps = complete_steps(root)
    return root / step_dir_name(steps[-1]) if steps else None


def check_engine(path: Path, engine: str) -> None:
    """Raise CheckpointError unless ``path`` is a complete checkpoint written by ``engine``."""
    if not is_complete(path):
        raise CheckpointError(f"{path}: not a complete t2train checkpoint (no metadata.json "
                              f"or {ENGINE_FILE})")
    written_by = checkpoint_engine(path)
    if written_by != engine:
        raise CheckpointError(f"{path}: written by train.engine={written_by}, this run uses "
                              f"train.engine={engine}; resume it with train.engine={written_by}")


def load_checkpoint(path: Path, objs: TrainingObjects, config=None) -> dict:
    """Collective: load model, optimizer, schedule and (same layout) RNG; returns train state.

    With the run's ``config``, a checkpoint of another model shape or residual design is
    refused naming the field; a missing shard file is named before anything is loaded.
    """
    check_engine(path, "megatron")
    common = _read(path, lambda: dist_checkpointing.load_common_state_dict(str(path)))
    if config is not None:
        check_same_model(path, common["train_state"].get("config", {}).get("model"), config.model)
    check_shard_files(path)
    saved_layout = common["train_state"]["layout"]
    same_layout = saved_layout == current_layout()

    state = _model_state(objs)
    has_optimizer = common["train_state"]["has_optimizer"]
    if has_optimizer:
        state["optimizer"] = objs.optimizer.sharded_state_dict(state, is_loading=True,
                                                               metadata=_OPTIMIZER_METADATA)
    if same_layout:
        state["rng_state"] = _rng_object(None)
    loaded = _read(path, lambda: dist_checkpointing.load(state, str(path)))

    for key, chunk in zip(_model_keys(objs), objs.model):
        chunk.module.load_state_dict(loaded[key])
    if has_optimizer:
        objs.optimizer.load_state_dict(loaded["optimizer"])
    objs.scheduler.num_steps = 0  # Megatron's scheduler load advances from the current count
    objs.scheduler.load_state_dict(common["scheduler"])
    if same_layout:
        restore_rng(loaded["rng_state"])
    elif dist.get_rank() == 0:
        warnings.warn(f"checkpoint layout {saved_layout} differs from {current_layout()}: "
                      "RNG streams start fresh")
    return common["train_state"]


def _read(path: Path, load: Callable):
    """Run a dist_checkpointing read, naming the checkpoint in any failure."""
    try:
        return load()
    except CheckpointError:
        raise
    except Exception as err:  # torch DCP and Megatron raise many types for unreadable data
        raise CheckpointError(f"{path}: cannot load the checkpoint ({type(err).__name__}: "
                              f"{str(err).strip().splitlines()[-1] if str(err).strip() else ''}); "
                              "it may be corrupt: resume from an earlier step_* "
                              "(checkpoint.resume=PATH)") from err
