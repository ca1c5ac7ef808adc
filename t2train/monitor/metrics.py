"""Where training numbers go: TensorBoard (scalars, images, histograms), a JSON-lines file
of the scalars beside the event files, and the console.

Only the logging rank (global rank 0) writes files; every other rank holds a ``Monitor``
without a run directory, which prints only when ``console`` is set (``log.all_ranks``, for
debugging), its lines prefixed with the rank.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Optional


def _format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def quiet_other_ranks(all_ranks: bool) -> None:
    """Python warnings and library log lines on global rank 0 only, unless ``log.all_ranks``.

    Called before the training libraries are imported, so it reads the rank the launcher put
    in the environment (``RANK``, as torch.distributed does). Errors still print everywhere.
    """
    if all_ranks or os.environ.get("RANK", "0") == "0":
        return
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


class Monitor:
    def __init__(self, run_dir: Optional[Path], total_steps: int, tensorboard: bool = True,
                 purge_step: Optional[int] = None, console: Optional[bool] = None,
                 prefix: str = ""):
        self.enabled = run_dir is not None
        self.console = self.enabled if console is None else console
        self.prefix = prefix
        self.total_steps = total_steps
        self.started = time.monotonic()
        self.writer = None
        self.jsonl = None
        if not self.enabled:
            return
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed run logged after its last checkpoint.
            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step)
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
        record = {"step": step, "time": time.time()}
        record.update({k: (v if math.isfinite(v) else str(v)) for k, v in values.items()})
        self.jsonl.write(json.dumps(record) + "\n")

    def image(self, step: int, tag: str, pixels) -> None:
        """An [height, width, 3] uint8 picture."""
        if self.writer is not None:
            self.writer.add_image(tag, pixels, step, dataformats="HWC")

    def histogram(self, step: int, tag: str, values) -> None:
        if self.writer is not None:
            self.writer.add_histogram(tag, values, step)

    def progress(self, step: int, loss: float, lr: float, tokens_per_sec: float,
                 steps_done_here: int) -> None:
        if not self.console:
            return
        elapsed = time.monotonic() - self.started
        eta = elapsed / max(steps_done_here, 1) * (self.total_steps - step)
        self.print(f"step {step:>6}/{self.total_steps} | loss {loss:7.4f} | lr {lr:.2e} | "
                   f"{tokens_per_sec:9.0f} tok/s | eta {_format_duration(eta)}")

    def print(self, message: str) -> None:
        if self.console:
            print(self.prefix + message, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
