"""Weights & Biases beside TensorBoard, in W&B's offline mode (no network): the run's scalars
reach a W&B run kept in the run directory, under an id derived from that directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from t2train.config.loader import load_config
from t2train.config.schema import ConfigError

LOG = """
import sys
from pathlib import Path
from t2train.config.loader import load_config
from t2train.monitor.metrics import Monitor
from t2train.monitor.wandb_sink import wandb_settings
run_dir = Path(sys.argv[1])
run_dir.mkdir()
config = load_config(overrides=["log.wandb=offline", f"log.run_dir={run_dir}", "name=demo"])
monitor = Monitor(run_dir, 3, tensorboard=False, wandb=wandb_settings(config))
monitor.scalars(1, {"train/loss": 5.25})
monitor.scalars(2, {"train/loss": 4.75, "val/loss": 4.875})
print(monitor.wandb.run.id, monitor.wandb.run.name)
monitor.close()  # commits the last step
"""


def test_scalars_are_logged_to_an_offline_wandb_run(tmp_path):
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install 't2train[wandb]'")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", LOG, str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=dict(os.environ, WANDB_API_KEY=""),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wandb:" not in proc.stdout + proc.stderr  # W&B's banner and summary: not shown
    run_id, name = proc.stdout.split()[-2:]
    assert f"W&B: run {run_id} (offline) in " in proc.stdout
    assert name == "run" and len(run_id) == 16  # named after the run directory
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    records = next(offline.glob("run-*.wandb")).read_bytes()
    assert f"run-{run_id}.wandb" in {p.name for p in offline.iterdir()}
    for logged in (b"train/loss", b"5.25", b"4.75", b"val/loss", b"4.875"):
        assert logged in records, logged


def test_wandb_needs_its_package_and_a_known_mode(monkeypatch):
    import importlib.util

    with pytest.raises(ConfigError, match="log.wandb='cloud'"):
        load_config(overrides=["log.wandb=cloud"])
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        ConfigError,
        match=r"log.wandb='offline': needs the wandb package: "
        r"pip install 't2train\[wandb\]'",
    ):
        load_config(overrides=["log.wandb=offline"])
