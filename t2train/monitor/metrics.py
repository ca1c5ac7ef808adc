"""Where training numbers go: TensorBoard (scalars, images, histograms), a JSON-lines file
of the scalars beside the event files, and the console.

The event files sit in the run directory itself, so ``tensorboard --logdir runs`` labels
each run by its name (``log.run_dir``, ``runs/{name}`` by default).

Only the logging rank (global rank 0) writes files; every other rank holds a ``Monitor``
without a run directory, which prints only when ``console`` is set (``log.all_ranks``, for
debugging), its lines prefixed with the rank.

The files hold one run: what an earlier attempt in the same directory logged after the step
this one starts from is dropped (a resumed run: the records after its checkpoint; a fresh
start: everything, e.g. the step-0 validation of an attempt that failed before its first
checkpoint), so no step appears twice in ``metrics.jsonl`` nor in TensorBoard.
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
from typing import Optional, TextIO


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


def _drop_records_after(path: Path, resumed_at: Optional[int]) -> list[str]:
    """Keep the records of steps up to ``resumed_at`` (none for a fresh start)."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines(keepends=True)
    kept = (
        [] if resumed_at is None else [line for line in lines if _record_step(line) <= resumed_at]
    )
    if len(kept) == len(lines):
        return []
    partial = path.with_name(path.name + ".tmp")
    partial.write_text("".join(kept))
    os.replace(partial, path)
    return [f"{len(lines) - len(kept)} {path.name} record(s)"]


def _record_step(line: str) -> float:
    """A record's step; a line cut short by a crash sorts after every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def _remove_event_files(folder: Path) -> list[str]:
    events = sorted(folder.glob("events.out.tfevents.*")) if folder.is_dir() else []
    for event_file in events:
        event_file.unlink()
    return [f"{len(events)} TensorBoard event file(s)"] if events else []


class Monitor:
    """``resumed_at``: the step of the checkpoint the run continues from, None for a fresh
    start (see the module's doc)."""

    def __init__(
        self,
        run_dir: Optional[Path],
        total_steps: int,
        tensorboard: bool = True,
        resumed_at: Optional[int] = None,
        console: Optional[bool] = None,
        prefix: str = "",
        wandb: Optional[dict] = None,
    ):
        """``wandb``: ``wandb.init`` arguments (``wandb_sink.wandb_settings``), or None."""
        self.enabled = run_dir is not None
        self.console = self.enabled if console is None else console
        self.prefix = prefix
        self.total_steps = total_steps
        self.started = time.monotonic()
        self.writer = None
        self.jsonl: Optional[TextIO] = None
        self.wandb = None
        if run_dir is None:
            return
        dropped = _drop_records_after(run_dir / "metrics.jsonl", resumed_at)
        if resumed_at is None:
            dropped += _remove_event_files(run_dir)
        if dropped:
            when = (
                f"after step {resumed_at}, its checkpoint"
                if resumed_at is not None
                else "without saving a checkpoint"
            )
            self.print(
                f"{run_dir}: dropped what an earlier attempt logged {when} ({', '.join(dropped)})"
            )
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - tensorboard: log.tensorboard only

            # purge_step drops the events an earlier attempt logged after the checkpoint.
            self.writer = SummaryWriter(
                str(run_dir), purge_step=(resumed_at + 1 if resumed_at is not None else None)
            )
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if wandb is not None:
            from t2train.monitor.wandb_sink import WandbSink  # noqa: PLC0415 - wandb: log.wandb only

            self.wandb = WandbSink(run_dir, wandb)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.jsonl is None:  # not enabled
            return
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
        record: dict[str, float | str] = {"step": step, "time": time.time()}
        record.update({k: (v if math.isfinite(v) else str(v)) for k, v in values.items()})
        self.jsonl.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.scalars(step, values)

    def image(self, step: int, tag: str, pixels) -> None:
        """An [height, width, 3] uint8 picture."""
        if self.writer is not None:
            self.writer.add_image(tag, pixels, step, dataformats="HWC")

    def histogram(self, step: int, tag: str, values) -> None:
        if self.writer is not None:
            self.writer.add_histogram(tag, values, step)

    def progress(
        self, step: int, loss: float, lr: float, tokens_per_sec: float, steps_done_here: int
    ) -> None:
        if not self.console:
            return
        elapsed = time.monotonic() - self.started
        eta = elapsed / max(steps_done_here, 1) * (self.total_steps - step)
        self.print(
            f"step {step:>6}/{self.total_steps} | loss {loss:7.4f} | lr {lr:.2e} | "
            f"{tokens_per_sec:9.0f} tok/s | eta {_format_duration(eta)}"
        )

    def print(self, message: str) -> None:
        if self.console:
            print(self.prefix + message, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.close()
