"""Names under ``<run_dir>/checkpoints``: one place for the on-disk layout.

    step_00000100/              a complete checkpoint (has metadata.json)
    step_00000200.incomplete/   being written, or left by a crash: never loaded
    latest                      the name of the newest complete checkpoint
"""

from __future__ import annotations

import re
from pathlib import Path

LATEST = "latest"
INCOMPLETE = ".incomplete"
STEP_DIR = re.compile(r"step_(\d{8})")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    """Megatron writes metadata.json last, once every rank's shards are written."""
    return (path / "metadata.json").is_file()


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete (published) checkpoints under ``root``, ascending."""
    if not root.is_dir():
        return []
    return sorted(int(match.group(1)) for path in root.iterdir()
                  if (match := STEP_DIR.fullmatch(path.name)) and is_complete(path))
