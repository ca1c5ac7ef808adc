"""What code this is: t2train's release and, from a git checkout, the commit.

Imports nothing heavy: ``t2train --version`` and the checkpoints' ``code_version`` use it.
"""

from __future__ import annotations

import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# The stack a run depends on, reported by ``t2train --version`` (from package metadata: no import).
STACK = ("torch", "megatron-core", "deepspeed", "mosaicml-streaming", "triton", "transformers")


def code_version() -> str:
    """t2train's version and, from a git checkout, the commit (``+dirty`` with local edits)."""
    release = _installed("t2train") or "unknown"
    repo = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return f"{release}+{commit}" if commit else release


def version_line() -> str:
    """``t2train 0.1.0+abc1234 (Python 3.11.7; torch 2.14.1, megatron-core 0.16.1, ...)``."""

    stack = ", ".join(f"{name} {_installed(name) or 'not installed'}" for name in STACK)
    return f"t2train {code_version()} (Python {platform.python_version()}; {stack})"


def _installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return ""
