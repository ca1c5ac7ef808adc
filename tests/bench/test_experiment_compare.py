"""`t2train experiment compare` end to end: a two-run batch interrupted in its second run,
then the same command again, which reads the finished run, resumes the other from its
checkpoint and writes the report and its figures."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import pytest
from test_compare_report import png_size

from t2train.checkpoint.store import find_latest
from t2train.signals import REQUEUE_EXIT_CODE

from bench_cli import run_cli
from suite_budget import patient

pytestmark = pytest.mark.slow

TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.warmup_steps=2",
    "train.eval_batches=2",
    "train.log_interval=1",
    "train.eval_interval=3",
    "checkpoint.interval=4",
    "log.tensorboard=false",
    "model.shortswa.window=16",
]
STEPS = 12
# The second variant: the mixer on, and a model option of its own.
VARIANTS = ["standard", "ddl+shortswa:model.ddl.dv=2"]


def _steps_logged(run_dir, key: str) -> list[int]:
    """The steps of the run's ``metrics.jsonl`` records holding ``key``, in file order."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [record["step"] for record in records if key in record]


def _interrupt_in_second_run(args: list[str], second_run) -> subprocess.CompletedProcess:
    """Run the batch, send SIGUSR1 once the second run has saved a checkpoint (it saves and
    stops at the next step), and wait for the batch to stop."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "t2train.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + patient(300)
    while find_latest(second_run / "checkpoints") is None:
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "no checkpoint of the second run in 300 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.filterwarnings("ignore:ignoring incomplete checkpoint")  # the poll sees a save
def test_interrupted_batch_resumes_and_writes_report_and_figures(shakespeare, tmp_path):
    out = tmp_path / "compare"
    args = [
        "experiment",
        "compare",
        f"data.path={shakespeare}",
        *TINY,
        "--designs",
        ",".join(VARIANTS),
        "--seeds",
        "1",
        "--steps",
        str(STEPS),
        "--out",
        str(out),
    ]
    first, second = (out / f"{variant}-seed1234" for variant in VARIANTS)

    stopped = _interrupt_in_second_run(args, second)
    assert stopped.returncode == REQUEUE_EXIT_CODE, stopped.stderr[-4000:]
    assert "batch stopped" in stopped.stdout and not (out / "compare.md").exists()
    assert STEPS in _steps_logged(first, "val/loss")
    assert max(_steps_logged(second, "train/loss")) < STEPS
    first_metrics = (first / "metrics.jsonl").read_bytes()

    code, printed = run_cli(*args)
    assert code == 0
    assert f"{first}: finished earlier" in printed
    assert (first / "metrics.jsonl").read_bytes() == first_metrics  # not trained again
    assert "resumed from" in printed
    # the records of both attempts, each step once (the first attempt's after its
    # checkpoint dropped)
    assert _steps_logged(second, "train/loss") == list(range(1, STEPS + 1))
    assert _steps_logged(second, "val/loss") == list(range(0, STEPS + 1, 3))
    assert "1 run(s) trained or resumed, 1 finished earlier" in printed

    report = (out / "compare.md").read_text()
    assert report in printed
    assert "whole files held out" not in report  # the fixture splits by sample, and says so
    rows: dict[str, list[str]] = {}  # the first table's (equal tokens)
    for line in report.splitlines():
        if line.startswith("| ") and not line.startswith("| variant"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows.setdefault(cells[0], cells)
    assert set(rows) == set(VARIANTS)
    assert rows["standard"][-1] == "(baseline)"
    loss = float(rows[VARIANTS[1]][5])  # mean val loss
    assert 0 < loss < math.log(2048)  # below uniform over the padded vocabulary
    for name in ("val_loss_vs_tokens.png", "val_loss_vs_flops.png"):
        assert f"![{name}]({name})" in report
        assert png_size(out / name) == (1200, 500)
