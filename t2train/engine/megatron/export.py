"""A Megatron engine checkpoint read for export: its weights into a model at TP = PP = 1
(``t2train export``, ``generate``, ``eval``). dist-checkpointing reshards on load."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from t2train.checkpoint.compatibility import check_shard_files
from t2train.checkpoint.errors import CheckpointError
from t2train.checkpoint.store import read_checkpoint
from t2train.model.gpt import EMBEDDING_WEIGHT


def load_for_export(path: Path, train_state: dict, build: Callable) -> tuple:
    """(model, stored dtype): ``build(rows, dtype)`` makes the model, the checkpoint fills it."""
    rows, stored = _embedding(path)
    model = build(rows, stored)
    loaded = read_checkpoint(
        path, lambda: dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path))
    )
    model.load_state_dict(loaded["model"])
    return model, stored


def _embedding(path: Path) -> tuple[int, torch.dtype]:
    """Rows and dtype of the saved embedding, from the shard index (nothing loaded)."""
    check_shard_files(path)  # names a missing or truncated shard (and an unreadable index)
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    entry = metadata.get(EMBEDDING_WEIGHT)
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointError(f"{path}: holds no model weights ({EMBEDDING_WEIGHT} is missing)")
    return entry.size[0], entry.properties.dtype
