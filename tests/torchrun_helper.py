"""Run a test worker under torchrun (real processes, gloo) and read back its JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"


# Set in this process by tests that join a one-rank world (``megatron_world``); a child
# trainer that inherited them would try to bind the same rendezvous port.
_WORLD_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child trainer: no inherited world, one thread."""
    env = {k: v for k, v in os.environ.items() if k not in _WORLD_VARIABLES}
    return dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def run_torchrun(worker: str, nproc: int, args: list[str], out: Path,
                 timeout: int = 600) -> dict:
    """Run ``tests/workers/<worker>`` on ``nproc`` ranks; it writes its result JSON to ``out``."""
    env = child_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(WORKERS / worker), "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"{worker} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return json.loads(out.read_text())
