"""A checkpoint of any layout as one TP = PP = 1 model in this process.

Megatron engine checkpoints (torch_dist) reshard on load: the model's sharded state dict at
TP = PP = 1 asks for whole tensors. DeepSpeed engine checkpoints hold one file set per
tensor-parallel rank (ZeRO-3 partitions parameters over data-parallel ranks too): each rank's
weights are gathered with DeepSpeed's own ``zero_to_fp32`` and the tensor-parallel shards
joined along each parameter's Megatron partition dimension.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Optional

import torch

from t2train.checkpoint.errors import CheckpointError
from t2train.checkpoint.inspect import read_train_state, resolve_checkpoint
from t2train.checkpoint.integrity import require_intact
from t2train.checkpoint.paths import checkpoint_engine
from t2train.config.schema import Config, ParallelConfig
from t2train.errors import UserInputError

EMBEDDING = "embedding.word_embeddings.weight"


@dataclass
class Checkpoint:
    """A resolved checkpoint and the run config it records (for TP = PP = 1, fp32 or bf16)."""

    path: Path
    train_state: dict
    config: Config


@dataclass
class LoadedModel:
    checkpoint: Checkpoint
    model: torch.nn.Module  # a T2GPTModel at TP = PP = 1, in eval mode
    vocab_size: int  # rows of the (padded) embedding


def open_checkpoint(given: str | Path) -> Checkpoint:
    """The newest complete checkpoint ``given`` leads to, with its config; nothing is loaded.

    A checkpoint without a recorded config, of an unknown design or with a config this
    version does not accept is refused naming the cause.
    """
    from t2train.config.loader import config_from_dict

    path = resolve_checkpoint(Path(given))
    state = read_train_state(path)
    if not isinstance(state.get("config"), dict):
        raise CheckpointError(
            f"{path}: records no run config (written by an older t2train); "
            "it cannot be rebuilt outside its run"
        )
    try:
        config = config_from_dict(state["config"], state.get("config_format", 1))
    except UserInputError as err:
        raise CheckpointError(f"{path}: its recorded config is not usable here ({err})") from None
    single = replace(
        config,
        parallel=ParallelConfig(),
        model=replace(config.model, recompute="none", attention_backend="sdpa"),
        train=replace(config.train, engine="megatron"),
    )
    return Checkpoint(path, state, single.validate())


def load_model(
    checkpoint: Checkpoint, device: Optional[str] = None, dtype: Optional[torch.dtype] = None
) -> LoadedModel:
    """The checkpoint's weights in a TP = PP = 1 model on ``device`` (default: CUDA if
    available) in ``dtype`` (default: the checkpoint's). A checkpoint whose files differ from
    the checksums recorded at save is refused before anything is built."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UserInputError("--device cuda: no CUDA device is available here; use --device cpu")
    single_process_world()
    require_intact(checkpoint.path)
    if checkpoint_engine(checkpoint.path) == "deepspeed":
        shards = _deepspeed_weights(checkpoint)
        if EMBEDDING not in shards[0]:
            raise CheckpointError(
                f"{checkpoint.path}: holds no model weights ({EMBEDDING} is missing)"
            )
        stored = shards[0][EMBEDDING].dtype
        rows = sum(shard[EMBEDDING].shape[0] for shard in shards.values())
        model = build_model(checkpoint.config, rows, stored)
        _load_gathered(model, _join_tensor_parallel(model, shards), checkpoint.path)
    else:
        rows, stored = _megatron_embedding(checkpoint.path)
        model = build_model(checkpoint.config, rows, stored)
        _load_megatron(model, checkpoint.path)
    if dtype is not None and dtype != stored:
        converted = build_model(checkpoint.config, model.vocab_size, dtype)
        converted.load_state_dict(model.state_dict())
        model = converted
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return LoadedModel(checkpoint, model.to(device).eval(), model.vocab_size)


def single_process_world() -> None:
    """torch.distributed and Megatron's groups for one process (TP = PP = DP = 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from t2train.parallel.init import init_distributed, init_model_parallel, set_seed

    init_distributed()
    if dist.get_world_size() != 1 or (
        parallel_state.model_parallel_is_initialized()
        and parallel_state.get_tensor_model_parallel_world_size()
        * parallel_state.get_pipeline_model_parallel_world_size()
        != 1
    ):
        raise UserInputError(
            "loading a checkpoint for export, generation or evaluation runs in "
            "one process: start it with python or t2train, not torchrun"
        )
    set_seed(0, init_model_parallel(1, 1, 1))


def build_model(config: Config, vocab_rows: int, dtype: torch.dtype):
    from t2train.model.build import build_model_chunks, transformer_config

    precision: Literal["bf16", "fp32"] = "bf16" if dtype == torch.bfloat16 else "fp32"
    if dtype not in (torch.bfloat16, torch.float32):
        raise CheckpointError(f"weights stored as {dtype}: expected float32 or bfloat16")
    config = replace(config, train=replace(config.train, precision=precision))
    (chunk,) = build_model_chunks(config, transformer_config(config), vocab_rows)
    return chunk


# --- Megatron engine ---------------------------------------------------------------------------


def _megatron_embedding(path: Path) -> tuple[int, torch.dtype]:
    """Rows and dtype of the saved embedding, from the shard index (nothing loaded)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from t2train.checkpoint.compatibility import check_shard_files

    check_shard_files(path)  # names a missing or truncated shard (and an unreadable index)
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    entry = metadata.get(EMBEDDING)
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointError(f"{path}: holds no model weights ({EMBEDDING} is missing)")
    return entry.size[0], entry.properties.dtype


def _load_megatron(model, path: Path) -> None:
    from megatron.core import dist_checkpointing

    from t2train.checkpoint.store import read_checkpoint

    loaded = read_checkpoint(
        path, lambda: dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path))
    )
    model.load_state_dict(loaded["model"])


# --- DeepSpeed engine --------------------------------------------------------------------------


def _deepspeed_weights(checkpoint: Checkpoint) -> dict[int, dict]:
    """{tensor-parallel rank: that rank's full (ZeRO-gathered) weights}, fp32 for ZeRO-3."""
    layout = checkpoint.train_state.get("layout") or {}
    ranks = layout.get("tp", 1)
    return {rank: _zero_gathered(checkpoint.path, rank) for rank in range(ranks)}


def _zero_gathered(path: Path, tp_rank: int) -> dict:
    """One tensor-parallel rank's weights: DeepSpeed's ``zero_to_fp32`` over that rank's files
    (it reads every ``*_model_states.pt`` / ``*_optim_states.pt`` of a folder: one rank's are
    linked into a folder of their own)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

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
    from megatron.core.transformer.mlp import MLP

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
