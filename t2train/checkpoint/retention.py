"""Which checkpoints to keep: the newest ``keep_last`` plus every ``keep_every``-th step."""

from __future__ import annotations

import shutil
from pathlib import Path

from t2train.checkpoint.paths import complete_steps, step_dir_name


def steps_to_delete(steps: list[int], keep_last: int, keep_every: int) -> list[int]:
    """The steps retention removes; ``keep_last=0`` keeps everything.

    The newest checkpoint is always kept (it is what ``latest`` names).
    """
    if keep_last == 0:
        return []
    kept = set(sorted(steps)[-keep_last:])
    if keep_every:
        kept |= {step for step in steps if step % keep_every == 0}
    return [step for step in steps if step not in kept]


def apply_retention(root: Path, keep_last: int, keep_every: int) -> list[Path]:
    """Delete the checkpoints retention does not keep (call on one rank); returns them."""
    removed = []
    for step in steps_to_delete(complete_steps(root), keep_last, keep_every):
        path = root / step_dir_name(step)
        # Renamed first, so a crash mid-delete never leaves a half-deleted "complete" checkpoint.
        doomed = path.with_name(path.name + ".deleting")
        path.rename(doomed)
        shutil.rmtree(doomed)
        removed.append(path)
    return removed
