"""What a finished (or stopped) run reports to its caller."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


@dataclass
class RunSummary:
    run_dir: Path
    start_step: int
    final_step: int
    losses: dict = field(default_factory=dict)  # step -> training loss
    val_losses: dict = field(default_factory=dict)  # step -> validation loss
    checkpoint: Optional[Path] = None  # the last saved (the newest published if that failed)
    stopped: Optional[str] = None  # why the run stopped before train.steps (signal, time limit)
    final_save_failed: bool = False  # the save of final_step failed (on_save_error=continue)
