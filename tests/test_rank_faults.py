"""Crashed and hung ranks (real torchrun processes, gloo).

* ``t2train launch --max-restarts=1``: one worker is SIGKILLed mid-run; the launcher
  restarts the workers, they resume from the newest checkpoint, and every step's final loss
  equals the uninterrupted run's;
* a rank that stops responding: after ``parallel.collective_timeout_mins`` its peer, blocked
  in the gradient all-reduce, ends naming the collective and itself (exit code 124).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from torchrun_helper import REPO, child_env

pytestmark = pytest.mark.slow

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.seq_length=64", "train.micro_batch_size=4", "train.global_batch_size=8",
        "train.warmup_steps=1", "train.eval_batches=1", "train.eval_interval=1000",
        "train.log_interval=1", "log.tensorboard=false", "log.diagnostics_interval=0",
        "train.steps=7", "checkpoint.interval=3"]


def _losses(run_dir: Path) -> dict[int, float]:
    """Each step's last logged loss (a restarted run logs the steps after its checkpoint
    again)."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] \
        if path.is_file() else []
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def _launch(data: Path, run_dir: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """Start ``t2train launch``; its output goes to a file (workers may outlive a pipe)."""
    cmd = [sys.executable, "-m", "t2train.launch", "--nproc-per-node=2", *extra, *TINY,
           f"data.path={data}", f"log.run_dir={run_dir}"]
    log = run_dir.with_suffix(".log")
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=out,
                                stderr=subprocess.STDOUT), log


def _worker(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "t2train.cli" in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker of rank {rank}")


def test_a_killed_rank_restarts_the_group_which_resumes(shakespeare, tmp_path):
    straight, log = _launch(shakespeare, tmp_path / "straight")
    assert straight.wait(timeout=600) == 0, log.read_text()[-4000:]
    reference = _losses(tmp_path / "straight")

    run_dir = tmp_path / "killed"
    # A survivor blocked in a collective with the dead rank ends within the timeout.
    launcher, log = _launch(shakespeare, run_dir, "--max-restarts=1",
                            "parallel.collective_timeout_mins=0.25")
    deadline = time.monotonic() + 300
    while max(_losses(run_dir), default=0) < 4:  # step 3 is saved, step 4 done
        assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    _worker(launcher, rank=1).send_signal(signal.SIGKILL)
    assert launcher.wait(timeout=600) == 0, log.read_text()[-6000:]
    out = log.read_text()
    assert "workers failed (exit code" in out and "restart 1 of 1" in out, out[-4000:]
    assert "resumed from " + str(run_dir / "checkpoints" / "step_00000003") in out \
        or "resumed from " + str(run_dir / "checkpoints" / "step_00000006") in out, out[-4000:]
    assert _losses(run_dir) == reference  # every step, bitwise


def test_a_hung_rank_times_out_naming_the_collective_and_rank(shakespeare, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", str(REPO / "tests" / "workers" / "faulty_train.py"), "hang",
           "2", "--", *TINY, f"data.path={shakespeare}", f"log.run_dir={tmp_path / 'run'}",
           "parallel.collective_timeout_mins=0.1"]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert ("rank 0: no progress for 6s in training step 2, blocked in torch.distributed "
            "_coalescing_manager from distributed/param_and_grad_buffer.py") in output, \
        output[-6000:]  # Megatron DDP's gradient all-reduce, waiting for the hung rank
    assert "(parallel.collective_timeout_mins=0.1)" in output
    assert "exitcode  : 124" in output
    assert time.monotonic() - started < 300
