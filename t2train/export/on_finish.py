"""``checkpoint.export_hf_on_finish``: the final checkpoint as a Hugging Face folder beside it.

Run by ``t2train train`` once training has finished: rank 0 starts ``t2train export hf`` as a
fresh process, since loading for export needs a one-process world and the trainer's ranks
still hold theirs (the launcher's variables are left out of the child's environment).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from t2train.errors import UserInputError

# What torchrun (and t2train launch) set for a rank; the export is a world of its own.
_LAUNCHER_VARIABLES = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
}


def export_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + "-hf")


def export_on_finish(config, summary) -> Optional[Path]:
    """The folder written for ``summary.checkpoint`` when the config asks for it (rank 0 only);
    ``UserInputError`` with the export's own error line if it fails."""
    from t2train.parallel.init import is_rank_zero

    if (
        not config.checkpoint.export_hf_on_finish
        or summary.stopped
        or summary.checkpoint is None
        or not is_rank_zero()
    ):
        return None
    out = export_path(Path(summary.checkpoint))
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _LAUNCHER_VARIABLES and not key.startswith("TORCHELASTIC_")
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "t2train.cli",
            "export",
            "hf",
            str(summary.checkpoint),
            str(out),
            "--overwrite",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        raise UserInputError(
            f"training finished, but checkpoint.export_hf_on_finish failed: "
            f"{lines[-1] if lines else f'exit code {proc.returncode}'}"
        )
    return out
