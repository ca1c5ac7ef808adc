"""Weights & Biases beside TensorBoard (``log.wandb=online|offline``): the same scalars.

Optional: the ``wandb`` package is installed with ``pip install 't2train[wandb]'`` (``make
install`` includes it). Only the logging rank writes. The W&B run lives in the run directory
(``<run_dir>/wandb``), is named after it and has an id derived from its path, so a resumed
run continues the same W&B run online. ``offline`` writes there without network (W&B starts
each attempt as its own ``offline-run-*`` folder under that id); ``wandb sync
<run_dir>/wandb/offline-run-*`` uploads them later. Images and histograms stay in TensorBoard.
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
        # offline, W&B ignores resume (and warns): each attempt is a new offline run
        **({"resume": "allow"} if config.log.wandb == "online" else {}),
        "config": asdict(config),
    }


class WandbSink:
    def __init__(self, run_dir: Path, settings: dict):
        import wandb  # noqa: PLC0415 - wandb: an optional extra

        run_dir.mkdir(parents=True, exist_ok=True)
        # W&B's own banner and summary are ~20 lines per run: one line here instead.
        self.run = wandb.init(dir=str(run_dir), settings=wandb.Settings(silent=True), **settings)
        print(f"W&B: run {self.run.id} ({settings['mode']}) in {self.run.dir}", flush=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
