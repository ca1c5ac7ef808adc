"""A process's signal masks, read from Linux's ``/proc/<pid>/status`` (tests that check how a
process stands towards a signal: ignored, caught, blocked or pending)."""

from __future__ import annotations

from pathlib import Path


def signal_masks(pid: int, task: int | None = None) -> dict[str, int]:
    """{"SigPnd": ..., "ShdPnd": ..., "SigBlk": ..., "SigIgn": ..., "SigCgt": ...} of process
    ``pid`` (or of its thread ``task``); bit ``signum - 1`` is that signal. Raises
    FileNotFoundError once the process has ended."""
    path = Path(f"/proc/{pid}/status" if task is None else f"/proc/{pid}/task/{task}/status")
    return {
        field: int(value, 16)
        for field, value in (
            line.split(":\t")
            for line in path.read_text().splitlines()
            if line.startswith(("SigPnd:", "ShdPnd:", "SigBlk:", "SigIgn:", "SigCgt:"))
        )
    }


def has(mask: int, signum: int) -> bool:
    return bool(mask >> (signum - 1) & 1)
