"""The trainer's checkpoint policy: when to save, sync or async, what to keep, what to log."""

from __future__ import annotations

import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from t2train.checkpoint.retention import apply_retention
from t2train.config.schema import Config


def code_version() -> str:
    """t2train's version and, from a git checkout, the commit (``+dirty`` with local edits)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("t2train")
    except PackageNotFoundError:
        release = "unknown"
    repo = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return f"{release}+{commit}" if commit else release


class Checkpointer:
    """Saves for the training loop; every method is a collective (all ranks call it).

    ``report(step, seconds_blocked, seconds_total, path)`` is told about each published save:
    sync saves block for their whole duration; async saves block only while
    the state is prepared and the writer forked.
    """

    def __init__(self, root: Path, config: Config, engine,
                 report: Callable[[int, float, float, Path], None]):
        self.root, self.engine, self.report = root, engine, report
        self.settings = config.checkpoint
        self.manifest = {"config": asdict(config), "code_version": code_version()}
        self.queue = None
        if self.settings.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.queue = AsyncCallsQueue()
        self._pending: dict[Path, tuple[int, float, float]] = {}  # path -> step, start, blocked

    def due(self, step: int, last_step: int) -> bool:
        return step % self.settings.interval == 0 or step == last_step

    def save(self, step: int, train_state: dict) -> Path:
        """Save ``step`` (waits for an async save still running: one in flight at a time)."""
        self.wait()
        started = time.monotonic()
        path = self.engine.save(self.root, step, dict(train_state, **self.manifest), self.queue,
                                self._published)
        blocked = time.monotonic() - started
        if self.queue is None:
            self.report(step, blocked, blocked, path)
        else:
            self._pending[path] = (step, started, blocked)
        return path

    def poll(self) -> None:
        """Publish a finished async save, without waiting for one still being written."""
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Publish every async save, waiting for the writers."""
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=True)

    def close(self) -> None:
        self.wait()
        if self.queue is not None:
            self.queue.close()

    def _published(self, path: Path) -> None:
        if dist.get_rank() == 0:
            apply_retention(self.root, self.settings.keep_last, self.settings.keep_every)
        if path in self._pending:
            step, started, blocked = self._pending.pop(path)
            self.report(step, blocked, time.monotonic() - started, path)
