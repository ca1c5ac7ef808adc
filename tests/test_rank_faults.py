"""A hung rank (real torchrun processes, gloo): after ``parallel.collective_timeout_mins``
its peer, blocked in the gradient all-reduce, ends naming the collective and itself (exit
code 124). A killed rank restarted by ``t2train launch --max-restarts``: tests/launch."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from torchrun_helper import REPO, child_env

pytestmark = pytest.mark.slow

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.seq_length=64", "train.micro_batch_size=4", "train.global_batch_size=8",
        "train.warmup_steps=1", "train.eval_batches=1", "train.eval_interval=1000",
        "train.log_interval=1", "log.tensorboard=false", "log.diagnostics_interval=0",
        "train.steps=7", "checkpoint.interval=3"]


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
