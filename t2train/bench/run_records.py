"""What a finished or interrupted run directory tells a batch: the validation losses it
logged, and whether it is a run of the same configuration.

A batch of runs (``t2train experiment compare``) is resumed by running the same command
again: a run whose ``metrics.jsonl`` holds the validation loss of its last step is finished
and is read, not retrained; any other is resumed from its newest checkpoint. Both are only
safe when the directory holds a run of the configuration asked for now.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from t2train.config.schema import Config


METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
VAL_LOSS = "val/loss"
# Config fields that do not change what a run computes, so they may differ between the
# attempts of one run: how it checkpoints and logs, and when it stops early.
RUN_CONTROL = ("checkpoint", "log", "train.exit_signals", "train.exit_duration_mins")


def val_curve(run_dir: Path) -> dict[int, float]:
    """step -> validation loss, from the run's ``metrics.jsonl`` (empty if there is none).

    A resumed run's file holds each step once (``t2train/monitor/metrics.py``); a line cut
    short by a crash is skipped.
    """
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return {}
    curve = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and VAL_LOSS in record:
            curve[int(record["step"])] = float(record[VAL_LOSS])  # "nan" is logged as text
    return curve


def finished_curve(run_dir: Path, steps: int) -> dict[int, float]:
    """The run's validation curve if it evaluated its last step ``steps``, else empty (a
    diverged run's NaN is a result too)."""
    curve = val_curve(run_dir)
    return curve if steps in curve else {}


def check_same_run(config: "Config", run_dir: Path) -> None:
    """Refuse to reuse or resume ``run_dir`` if its saved config computes something else."""
    # Deferred: the records alone (val_curve, finished_curve) are read where the config's
    # imports (torch, megatron-core) are not installed yet (tools/gpu_check/compare.py).
    from t2train.config.loader import config_to_dict, flatten, load_config
    from t2train.config.schema import ConfigError

    saved = run_dir / CONFIG_FILE
    if not saved.is_file():
        return
    then, now = (
        flatten(config_to_dict(load_config(None, str(saved)))),
        flatten(config_to_dict(config)),
    )
    changed = [
        key
        for key in sorted(then.keys() | now.keys())
        if not _run_control(key) and then.get(key) != now.get(key)
    ]
    if changed:
        key = changed[0]
        more = f" (and {len(changed) - 1} more field(s))" if len(changed) > 1 else ""
        raise ConfigError(
            f"{run_dir}: holds a run with {key}={then.get(key)!r}, this batch "
            f"asks for {now.get(key)!r}{more}; give the batch another --out, or "
            "remove that run directory to train it again"
        )


def _run_control(key: str) -> bool:
    return any(key == field or key.startswith(field + ".") for field in RUN_CONTROL)
