"""Run the benchmark commands as a user does."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> tuple[int, str]:
    """``t2train ARGS`` in a fresh process (its torch.distributed world stays out of the
    test process, where later tests expect none); returns the exit code and stdout."""
    proc = subprocess.run(
        [sys.executable, "-m", "t2train.cli", *args], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.returncode, proc.stdout
