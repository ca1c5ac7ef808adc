"""Weights & Biases beside TensorBoard (``log.wandb=online|offline``): the same scalars.

Optional: the ``wandb`` package is installed with ``pip install 't2train[wandb]'`` (``make
install`` includes it). Only the logging rank writes. The W&B run lives in the run directory
(``<run_dir>/wandb``), is named after it and has an id derived from its path, so a resumed
run continues the same W&B run. ``offline`` writes there without network; ``wandb sync
<run_dir>/wandb/offline-run-*`` uploads it later. Images and histograms stay in TensorBoard.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path
from typing import Optional


def wandb_settings(config) -> Optional[dict]:
    """``wandb.init`` arguments of the run (without its directory), or None when off."""
    if config.log.wandb == "off":
        return None
    run_dir = Path(config.run_dir)
    return {
        "project": config.log.wandb_project,
        "name": run_dir.name,
        "mode": config.log.wandb,
        "id": hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16],
        "resume": "allow",
        "config": asdict(config),
    }


class WandbSink:
    def __init__(self, run_dir: Path, settings: dict):
        import wandb  # noqa: PLC0415 - wandb: an optional extra

        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(dir=str(run_dir), **settings)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
