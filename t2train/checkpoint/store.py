"""Checkpoint directories: atomic publication, finding the newest, what every engine saves.

Every rank writes its shards into ``step_N.incomplete/`` (``paths.py``); once all are done,
``publish_checkpoint`` renames it to ``step_N/`` and then replaces ``latest``. A crash at any
point leaves the previous checkpoint and marker intact. What goes into the shards is the
engine's business (``t2train/engine/``); the RNG streams and the layout recorded here are
common to both engines.
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
from megatron.core import parallel_state

from t2train.checkpoint.errors import CheckpointError
from t2train.checkpoint.integrity import record_checksums
from t2train.checkpoint.paths import (
    ENGINE_FILE,
    INCOMPLETE,
    LATEST,
    checkpoint_engine,
    complete_steps,
    is_complete,
    step_dir_name,
)


def current_layout() -> dict:
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
    }


def capture_rng() -> list:
    from megatron.core import tensor_parallel  # noqa: PLC0415 - megatron-core: not for `t2train config`, which reads find_latest

    return [
        {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
        }
    ]


def restore_rng(states: list) -> None:
    from megatron.core import tensor_parallel  # noqa: PLC0415 - megatron-core: not for `t2train config`, which reads find_latest

    state = states[0]
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def publish_checkpoint(
    root: Path, staging: Path, final: Path, on_published: Optional[Callable[[Path], None]]
) -> None:
    """Collective: record the files' checksums, rename the finished staging directory and
    point ``latest`` at it."""
    dist.barrier()
    record_checksums(staging)
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


def find_latest(root: Path, warn_incomplete: bool = True) -> Optional[Path]:
    """The newest complete checkpoint under ``root``; half-written ones are skipped (with a
    warning each, unless ``warn_incomplete`` is False: a training run removes them and says
    so, ``remove_unfinished``)."""
    if not root.is_dir():
        return None
    for leftover in sorted(root.glob("*" + INCOMPLETE)) if warn_incomplete else ():
        warnings.warn(
            f"ignoring incomplete checkpoint {leftover} (a save was interrupted)", stacklevel=2
        )
    marker = root / LATEST
    if marker.is_file():
        named = root / marker.read_text().strip()
        if is_complete(named):
            return named
        warnings.warn(
            f"{marker} names {named.name}, which is not a complete checkpoint", stacklevel=2
        )
    steps = complete_steps(root)
    return root / step_dir_name(steps[-1]) if steps else None


def remove_unfinished(root: Path) -> dict[Path, Optional[OSError]]:
    """Delete the staging directories of saves that never finished (their run was killed);
    each one found -> None once removed, or the error that kept it (a file the filesystem
    will not delete: the run goes on, and a save of that step fails as any failed save).
    Only for the run directory's lock holder: a live run's save is one."""
    found: dict[Path, Optional[OSError]] = {}
    for staging in sorted(root.glob("*" + INCOMPLETE)) if root.is_dir() else []:
        try:
            shutil.rmtree(staging)
            found[staging] = None
        except OSError as err:
            found[staging] = err
    return found


def check_engine(path: Path, engine: str) -> None:
    """Raise CheckpointError unless ``path`` is a complete checkpoint written by ``engine``."""
    if not is_complete(path):
        raise CheckpointError(
            f"{path}: not a complete t2train checkpoint (no metadata.json or {ENGINE_FILE})"
        )
    written_by = checkpoint_engine(path)
    if written_by != engine:
        raise CheckpointError(
            f"{path}: written by train.engine={written_by}, this run uses "
            f"train.engine={engine}; resume it with train.engine={written_by}"
        )


def read_checkpoint(path: Path, load: Callable):
    """Run a dist_checkpointing read, naming the checkpoint in any failure."""
    try:
        return load()
    except CheckpointError:
        raise
    except Exception as err:  # torch DCP and Megatron raise many types for unreadable data
        raise CheckpointError(
            f"{path}: cannot load the checkpoint ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[-1] if str(err).strip() else ''}); "
            "it may be corrupt: resume from an earlier step_* "
            "(checkpoint.resume=PATH)"
        ) from err
