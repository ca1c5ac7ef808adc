"""A checkpoint of any layout as one TP = PP = 1 model in this process.

The engine that wrote the checkpoint reads it (``t2train.engine.export_reader``): Megatron
engine checkpoints reshard on load (``engine/megatron/export.py``), DeepSpeed's are gathered
per tensor-parallel rank and joined (``engine/deepspeed/export.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Optional

import torch

from t2train.checkpoint.errors import CheckpointError
from t2train.checkpoint.inspect import resolve_checkpoint
from t2train.checkpoint.integrity import require_intact
from t2train.checkpoint.paths import checkpoint_engine
from t2train.checkpoint.train_state import read_train_state
from t2train.config.schema import Config, ParallelConfig
from t2train.engine import export_reader
from t2train.errors import UserInputError
from t2train.parallel.init import environment_kept, one_process_world


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
    with environment_kept():  # Megatron's model build sets NVTE_* attention variables
        single_process_world()
        require_intact(checkpoint.path)
        read = export_reader(checkpoint_engine(checkpoint.path))
        model, stored = read(
            checkpoint.path,
            checkpoint.train_state,
            lambda rows, dtype: build_model(checkpoint.config, rows, dtype),
        )
        if dtype is not None and dtype != stored:
            converted = build_model(checkpoint.config, model.vocab_size, dtype)
            converted.load_state_dict(model.state_dict())
            model = converted
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return LoadedModel(checkpoint, model.to(device).eval(), model.vocab_size)


def single_process_world() -> None:
    """torch.distributed and Megatron's groups for one process (TP = PP = DP = 1); the
    environment is left as it was (``environment_kept``)."""
    if not one_process_world():
        raise UserInputError(
            "loading a checkpoint for export, generation or evaluation runs in "
            "one process: start it with python or t2train, not torchrun"
        )


def build_model(config: Config, vocab_rows: int, dtype: torch.dtype):
    from t2train.model.build import build_model_chunks, transformer_config

    precision: Literal["bf16", "fp32"] = "bf16" if dtype == torch.bfloat16 else "fp32"
    if dtype not in (torch.bfloat16, torch.float32):
        raise CheckpointError(f"weights stored as {dtype}: expected float32 or bfloat16")
    config = replace(config, train=replace(config.train, precision=precision))
    (chunk,) = build_model_chunks(config, transformer_config(config), vocab_rows)
    return chunk
