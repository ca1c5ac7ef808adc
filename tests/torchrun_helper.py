"""Run a test worker under torchrun (real processes, gloo) and read back its JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from suite_budget import patient

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child trainer, with one thread per process."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def run_torchrun(
    worker: str, nproc: int, args: list[str], out: Path, timeout: int = 600, **env_extra: str
) -> dict:
    """Run ``tests/workers/<worker>`` on ``nproc`` ranks; it writes its result JSON to ``out``.
    The console output (stdout, then stderr) is kept in ``out`` with the suffix ``.log``.
    ``env_extra``: variables added to the ranks' environment."""
    env = child_env(**env_extra)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKERS / worker),
        "--out",
        str(out),
        *args,
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=patient(timeout), env=env, cwd=REPO
    )
    out.with_suffix(".log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(
            f"{worker} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return json.loads(out.read_text())


def faulty_train_command(
    nproc: int, fault: str, first_step: int, train_args: list[str]
) -> list[str]:
    """torchrun starting ``nproc`` ranks of ``t2train train train_args`` with ``fault``
    injected from the ``first_step``-th step (tests/workers/faulty_train.py)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKERS / "faulty_train.py"),
        fault,
        str(first_step),
        "--",
        *train_args,
    ]
