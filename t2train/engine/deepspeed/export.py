"""A DeepSpeed engine checkpoint's weights read outside DeepSpeed: each tensor-parallel
rank's ZeRO shards gathered (DeepSpeed's ``zero_to_fp32``), the ranks joined, and the parts
a model of another layout holds taken from them (``engine/split_weights.py``). For export
that model is TP = PP = 1 (``load_for_export``); a run starting from the checkpoint
(``checkpoint.init_from``) takes this rank's parts at its own TP and PP (``read_weights``)."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from megatron.core import parallel_state as ps

from t2train.checkpoint.errors import CheckpointError
from t2train.engine.split_weights import parts_of
from t2train.model.gpt import EMBEDDING_WEIGHT

WHAT = "the DeepSpeed weights"  # as an error names them


def load_for_export(path: Path, train_state: dict, build: Callable) -> tuple:
    """(model, stored dtype): ``build(rows, dtype)`` makes the model, the gathered weights
    fill it (fp32 for ZeRO-3)."""
    shards = _gathered_shards(path, range(_written_tp(train_state)))
    stored = shards[0][EMBEDDING_WEIGHT].dtype
    model = build(sum(shard[EMBEDDING_WEIGHT].shape[0] for shard in shards), stored)
    model.load_state_dict(parts_of(model, shards, path, (1, 0), WHAT))
    return model, stored


def read_weights(path: Path, train_state: dict, chunks: list) -> list[dict]:
    """Each bare chunk's weights at this rank's layout (``t2train.engine.start_weights``).
    Every rank gathers the checkpoint's tensor-parallel ranks in fp32 on the host, as
    zero_to_fp32 does: only its own when the run has the checkpoint's TP size, else all."""
    written = _written_tp(train_state)
    size, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    # At the written size this rank's part is one written rank's, taken whole.
    ranks, split = ([rank], (1, 0)) if written == size else (range(written), (size, rank))
    shards = _gathered_shards(path, ranks)
    return [parts_of(chunk, shards, path, split, WHAT) for chunk in chunks]


def _written_tp(train_state: dict) -> int:
    return (train_state.get("layout") or {}).get("tp", 1)


def _gathered_shards(path: Path, tp_ranks: Iterable[int]) -> list[dict]:
    """The whole (un-ZeRO-ed) state dict of each of these tensor-parallel ranks."""
    shards = [_zero_gathered(path, rank) for rank in tp_ranks]
    if EMBEDDING_WEIGHT not in shards[0]:
        raise CheckpointError(f"{path}: holds no model weights ({EMBEDDING_WEIGHT} is missing)")
    return shards


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
