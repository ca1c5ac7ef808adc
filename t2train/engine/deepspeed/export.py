"""A DeepSpeed engine checkpoint read for export: each tensor-parallel rank's ZeRO shards
gathered (DeepSpeed's ``zero_to_fp32``), the ranks joined, into a model at TP = PP = 1."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from megatron.core.transformer.mlp import MLP

from t2train.checkpoint.errors import CheckpointError
from t2train.model.gpt import EMBEDDING_WEIGHT


def load_for_export(path: Path, train_state: dict, build: Callable) -> tuple:
    """(model, stored dtype): ``build(rows, dtype)`` makes the model, the gathered weights
    fill it (fp32 for ZeRO-3)."""
    ranks = (train_state.get("layout") or {}).get("tp", 1)
    shards = {rank: _zero_gathered(path, rank) for rank in range(ranks)}
    if EMBEDDING_WEIGHT not in shards[0]:
        raise CheckpointError(f"{path}: holds no model weights ({EMBEDDING_WEIGHT} is missing)")
    stored = shards[0][EMBEDDING_WEIGHT].dtype
    model = build(sum(shard[EMBEDDING_WEIGHT].shape[0] for shard in shards.values()), stored)
    _load_gathered(model, _join_tensor_parallel(model, shards), path)
    return model, stored


def _zero_gathered(path: Path, tp_rank: int) -> dict:
    """One tensor-parallel rank's weights: DeepSpeed's ``zero_to_fp32`` over that rank's files
    (it reads every ``*_model_states.pt`` / ``*_optim_states.pt`` of a folder: one rank's are
    linked into a folder of their own)."""
    files = sorted(path.glob(f"*mp_rank_{tp_rank:02d}_*states.pt"))
    if not files:
        raise CheckpointError(
            f"{path}: no DeepSpeed files of tensor-parallel rank {tp_rank} "
            f"(*mp_rank_{tp_rank:02d}_*states.pt)"
        )
    with tempfile.TemporaryDirectory(prefix="t2train-zero-") as scratch:
        folder = Path(scratch) / "rank"
        folder.mkdir()
        for file in files:
            os.symlink(file.resolve(), folder / file.name)
        quiet = io.StringIO()  # zero_to_fp32 prints its progress
        try:
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                return get_fp32_state_dict_from_zero_checkpoint(scratch, tag="rank")
        except Exception as err:  # DeepSpeed raises many types for unreadable files
            lines = str(err).strip().splitlines()
            raise CheckpointError(
                f"{path}: cannot gather the DeepSpeed weights of tensor-parallel "
                f"rank {tp_rank} ({type(err).__name__}: "
                f"{lines[-1] if lines else ''})"
            ) from err


def _join_tensor_parallel(model, shards: dict[int, dict]) -> dict:
    """Whole tensors from each tensor-parallel rank's shards.

    A Megatron parallel parameter is split along its ``partition_dim``; the gated MLP's fc1
    holds [gate; up] on each rank, so its halves are joined separately.
    """
    if len(shards) == 1:
        return shards[0]
    gated = {
        f"{name}.linear_fc1.weight"
        for name, module in model.named_modules()
        if isinstance(module, MLP) and module.config.gated_linear_unit
    }
    parameters = dict(model.named_parameters())
    joined = {}
    for key, first in shards[0].items():
        parts = [shards[rank][key] for rank in sorted(shards)]
        param = parameters.get(key)
        if param is None or not getattr(param, "tensor_model_parallel", False):
            joined[key] = first
            continue
        dim = param.partition_dim
        if key in gated:
            halves = [part.chunk(2, dim=dim) for part in parts]
            joined[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
        else:
            joined[key] = torch.cat(parts, dim=dim)
    return joined


def _load_gathered(model, weights: dict, path: Path) -> None:
    expected = {key for key in model.state_dict() if not key.endswith("_extra_state")}
    missing = sorted(expected - weights.keys())
    if missing:
        raise CheckpointError(
            f"{path}: the DeepSpeed weights lack {missing[0]}"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}"
        )
    try:
        model.load_state_dict({key: weights[key] for key in expected}, strict=False)
    except RuntimeError as err:
        raise CheckpointError(
            f"{path}: the DeepSpeed weights do not fit the recorded model "
            f"({str(err).strip().splitlines()[-1]})"
        ) from None
