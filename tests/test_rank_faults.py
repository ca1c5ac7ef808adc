"""Faults one rank sees (real torchrun processes, gloo).

* A hung rank: after ``parallel.collective_timeout_mins`` its peer, blocked in the gradient
  all-reduce, ends naming the collective and itself (exit code 124).
* A failure one rank sees alone inside a checkpoint save, while the others wait for it in
  one of the save's collectives: every rank ends within seconds with that rank's error
  (exit code 3), also with ``checkpoint.on_save_error=continue``.

A killed rank restarted by ``t2train launch --max-restarts``: tests/launch.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time

import psutil
import pytest

from proc_signals import has, signal_masks
from torchrun_helper import REPO, child_env, faulty_train_command

pytestmark = pytest.mark.slow

TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.warmup_steps=1",
    "train.eval_batches=1",
    "train.eval_interval=1000",
    "train.log_interval=1",
    "log.tensorboard=false",
    "log.diagnostics_interval=0",
    "train.steps=7",
    "checkpoint.interval=3",
]


def _kill_the_frozen_rank_once_asked_to_stop(launcher_pid: int) -> int:
    """Once its peer has failed, torchrun sends every worker SIGTERM and waits 30 s (a fixed
    grace, not ``--shutdown-timeout``) before SIGKILL; the SIGSTOPped rank cannot act on it.
    The test kills it as soon as the SIGTERM is pending, sparing the suite that wait. Returns
    how many it killed."""
    try:
        workers = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    killed = 0
    for worker in workers:
        try:
            stopped = worker.status() == psutil.STATUS_STOPPED
            masks = signal_masks(worker.pid)
        except (psutil.NoSuchProcess, FileNotFoundError):
            continue
        if stopped and has(masks["SigPnd"] | masks["ShdPnd"], signal.SIGTERM):
            worker.kill()
            killed += 1
    return killed


def test_a_hung_rank_times_out_naming_the_collective_and_rank(shakespeare, tmp_path):
    cmd = faulty_train_command(
        2,
        "hang",
        2,
        [
            *TINY,
            f"data.path={shakespeare}",
            f"log.run_dir={tmp_path / 'run'}",
            "parallel.collective_timeout_mins=0.1",
        ],
    )
    started, killed = time.monotonic(), 0
    with open(tmp_path / "out", "w+") as out:
        launcher = subprocess.Popen(
            cmd, cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT, text=True
        )
        while launcher.poll() is None and time.monotonic() - started < 600:
            killed += _kill_the_frozen_rank_once_asked_to_stop(launcher.pid)
            time.sleep(0.2)
        launcher.kill()  # no-op unless the deadline passed
        returncode = launcher.wait()
        out.seek(0)
        output = out.read()
    assert returncode != 0, output[-4000:]
    assert (
        "rank 0: no progress for 6s in training step 2, blocked in torch.distributed "
        "_coalescing_manager from distributed/param_and_grad_buffer.py"
    ) in output, output[-6000:]  # Megatron DDP's gradient all-reduce, waiting for the hung rank
    blocked = re.search(
        r"\(parallel.collective_timeout_mins=0.1; its main thread used ([\d.]+) s of CPU in the "
        r"last ([\d.]+) s\); a peer rank is probably dead or stuck",
        output,
    )
    assert blocked, output[-6000:]
    print(f"a rank blocked in a collective used {blocked[1]} s of CPU in {blocked[2]} s")
    assert "exitcode  : 124" in output
    assert killed == 1  # the frozen rank, after torchrun's SIGTERM
    assert time.monotonic() - started < 300


@pytest.mark.parametrize(
    "nproc, fault, rank, cause",
    [
        (2, "save_metadata", 0, "OSError: [Errno 28] No space left on device: "),
        (4, "save_state", 3, "CheckpointingException: cannot collect this rank's sharded state"),
    ],
)
def test_a_save_fault_one_rank_sees_ends_every_rank_with_its_error(
    shakespeare, tmp_path, nproc, fault, rank, cause
):
    run_dir = tmp_path / "run"
    cmd = faulty_train_command(
        nproc,
        fault,
        1,
        [
            *TINY,
            f"data.path={shakespeare}",
            f"log.run_dir={run_dir}",
            "train.micro_batch_size=2",
            "train.steps=2",
            "checkpoint.interval=1",
            "checkpoint.on_save_error=continue",
        ],
    )
    proc = subprocess.run(
        cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600
    )
    ended = time.time()
    output = proc.stdout + proc.stderr
    fired = re.findall(rf"fault on rank {rank} at ([\d.]+)", proc.stderr)
    assert len(fired) == 1, output[-6000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == nproc and len(set(errors)) == 1, output[-6000:]  # one each, the same
    assert (
        f"checkpoint save of step 1 to {run_dir}/checkpoints/step_00000001.incomplete" in errors[0]
        and f"failed: rank {rank}: {cause}" in errors[0]
    ), errors[0]
    assert f"Every rank stops: rank {rank} failed alone inside the save" in errors[0]
    assert re.findall(r"exitcode\s+: (\S+)", output) == ["3"] * nproc, output[-4000:]
    assert not (run_dir / "checkpoints" / "latest").exists()
    seconds = ended - float(fired[0])
    print(f"{nproc} ranks, fault on rank {rank}: all exited {seconds:.1f}s after it")
    # Far below the 10 min the peers would wait in a collective (parallel.collective_timeout_mins)
    # and still true on a loaded machine, where tearing down the ranks takes a while.
    assert seconds < 120
