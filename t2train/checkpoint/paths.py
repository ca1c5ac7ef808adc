"""Names under ``<run_dir>/checkpoints``: one place for the on-disk layout.

    step_00000100/              a complete checkpoint (Megatron's metadata.json, or
                                t2train_engine.json for a DeepSpeed engine checkpoint)
    step_00000200.incomplete/   being written, or left by a crash: never loaded
    latest                      the name of the newest complete checkpoint

A complete checkpoint also holds ``t2train_checksums.json``: every file's size and checksum,
written when it was published (``integrity.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

LATEST = "latest"
ENGINE_FILE = "t2train_engine.json"  # written last into a DeepSpeed engine checkpoint
INCOMPLETE = ".incomplete"
CHECKSUMS = "t2train_checksums.json"  # written into a checkpoint just before it is published
STEP_DIR = re.compile(r"step_(\d{8})")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    """Megatron writes metadata.json last, once every rank's shards are written; the
    DeepSpeed engine writes ENGINE_FILE last."""
    return (path / "metadata.json").is_file() or (path / ENGINE_FILE).is_file()


def checkpoint_engine(path: Path) -> str:
    """``train.engine`` of the run that wrote a complete checkpoint."""
    marker = path / ENGINE_FILE
    return json.loads(marker.read_text())["engine"] if marker.is_file() else "megatron"


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete (published) checkpoints under ``root``, ascending."""
    if not root.is_dir():
        return []
    return sorted(
        int(match.group(1))
        for path in root.iterdir()
        if (match := STEP_DIR.fullmatch(path.name)) and is_complete(path)
    )
