"""A checkpoint's train state (step, tokens, layout, config, ...) read back from its files,
whichever engine wrote it: an engine file carrying it as JSON (``ENGINE_FILE``, which the
DeepSpeed engine writes last), else the ``common.pt`` of a dist-checkpointing checkpoint.
Light: megatron-core loads only when a ``common.pt`` is read."""

from __future__ import annotations

import json
from pathlib import Path

from t2train.checkpoint.errors import CheckpointError
from t2train.checkpoint.paths import ENGINE_FILE, is_complete


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file}: cannot read ({type(err).__name__}: {err})") from None


def read_train_state(path: Path) -> dict:
    """The checkpoint's train state (step, tokens, layout, config, ...)."""
    if not is_complete(path):
        raise CheckpointError(f"{path}: not a complete t2train checkpoint (no metadata.json)")
    if (path / ENGINE_FILE).is_file():
        return _read_json(path / ENGINE_FILE)
    _read_json(path / "metadata.json")  # read first: Megatron's errors would blame common.pt
    from megatron.core import dist_checkpointing  # noqa: PLC0415 - megatron-core: not for a checkpoint with its state in JSON, nor `t2train ckpt --help`

    try:
        return dist_checkpointing.load_common_state_dict(str(path))["train_state"]
    except Exception as err:
        # torch.load's weights_only refusal spans lines; the one naming the object says why
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        why = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")
        raise CheckpointError(
            f"{path}/common.pt: cannot read ({type(err).__name__}: {why}; "
            "checkpoints are loaded as data only)"
        ) from err
