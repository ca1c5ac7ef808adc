"""The GPU comparison completed over two short windows, dry-run on the CPU: the first window's
time budget lets one run of two finish, and its report lists the other as missing; only the
finished run's records come back; the second window, given those records (as the repository
keeps them), reads that run and trains the other; merging its records here writes the report
over both without training anything."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tools.gpu_check.compare import batch_spec

pytestmark = pytest.mark.slow


def _window(out, records, data, budget_min):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.gpu_check.compare",
            str(out),
            "--records",
            str(records),
            "--data",
            str(data),
            "--dry-run",
            "--budget-min",
            str(budget_min),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_batch_completed_over_two_windows_and_merged(shakespeare, tmp_path):
    records = tmp_path / "docs-compare-gpu"  # what the repository keeps between windows
    # Window 1: a budget far below one run's time; the first run always starts.
    first = _window(tmp_path / "out1", records, shakespeare, budget_min=0.001)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "not run (--time-budget-min=0.001): 1 of 2 run(s): ddl-seed1234" in first.stdout
    back = tmp_path / "out1" / "records"
    assert sorted(p.name for p in back.iterdir()) == [
        "compare.md",
        "standard-seed1234",
        "val_loss_vs_flops.png",
        "val_loss_vs_tokens.png",
    ]
    assert sorted(p.name for p in (back / "standard-seed1234").iterdir()) == [
        "config.yaml",
        "metrics.jsonl",
    ]  # no checkpoint travels

    assert (
        "not finished yet, so not in the tables: 1 run(s) (ddl-seed1234)"
        in (back / "compare.md").read_text()
    )
    shutil.copytree(back / "standard-seed1234", records / "standard-seed1234")  # committed
    standard_metrics = (records / "standard-seed1234" / "metrics.jsonl").read_bytes()

    # Window 2, on a fresh machine: the committed record stands for the finished run.
    second = _window(tmp_path / "out2", records, shakespeare, budget_min=30)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "1 run(s) finished in earlier jobs" in second.stdout
    assert "finished earlier, read its validation losses" in second.stdout
    assert "this job finished 1 run(s): ddl-seed1234" in second.stdout

    merged = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.gpu_check.compare",
            "--merge",
            str(tmp_path / "out2" / "records"),
            "--records",
            str(records),
            "--data",
            str(shakespeare),
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert merged.returncode == 0, merged.stderr[-4000:]
    assert "not run" not in merged.stdout and "0 run(s) trained or resumed" in merged.stdout
    assert (records / "standard-seed1234" / "metrics.jsonl").read_bytes() == standard_metrics
    report = (records / "compare.md").read_text()
    assert "| ddl " in report and "not finished yet" not in report
    for run in ("standard-seed1234", "ddl-seed1234"):
        steps = [
            json.loads(line)["step"]
            for line in (records / run / "metrics.jsonl").open()
            if "val/loss" in line
        ]
        assert steps[-1] == batch_spec(dry_run=True)["steps"]
