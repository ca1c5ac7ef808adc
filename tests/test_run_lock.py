"""One writer per run directory (t2train/run_lock.py): a second run on a live run
directory is refused in one line naming the holder and touches nothing; a lock whose holder
has ended is taken, whether the OS lock went with it or (on a filesystem that does not carry
flock between nodes) only its record and heartbeat are left."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from t2train import run_lock
from t2train.run_lock import LOCK_FILE, RunDirectoryInUse, RunLock

from suite_budget import patient

REPO = Path(__file__).resolve().parents[1]


def _record(run_dir: Path, age: float = 0.0, **holder) -> Path:
    """A lock file as a run elsewhere left it: its holder, and a heartbeat ``age`` s old."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    path.write_text(
        json.dumps(
            dict(
                {"host": "node-b", "pid": 4242, "job": "", "started": time.time() - 3600}, **holder
            )
        )
        + "\n"
    )
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_a_lock_held_by_a_live_process_is_refused_naming_it(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from t2train.run_lock import RunLock; lock = RunLock(Path(sys.argv[1])); "
            "print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunDirectoryInUse) as refused:
            RunLock(tmp_path)
        message = str(refused.value)
        assert (
            f"run directory {tmp_path} is in use by another run (host "
            f"{socket.gethostname()}, pid {holder.pid}," in message
        )
        assert "it holds its lock" in message and "Nothing was written" in message
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(tmp_path)  # the kernel released it with the process
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_run_that_made_the_directory_and_wrote_nothing_leaves_none(tmp_path):
    RunLock(tmp_path / "new").release()
    assert not (tmp_path / "new").exists()
    (tmp_path / "used").mkdir()
    RunLock(tmp_path / "used").release()
    assert (tmp_path / "used").is_dir()


@pytest.mark.parametrize(
    "holder, age, taken",
    [
        ({}, 5.0, False),  # another host, fresh heartbeat: flock may not reach it
        ({}, run_lock.STALE + 5, True),  # another host, stale heartbeat: it has ended
        ({"job": "777"}, 5.0, True),  # an earlier attempt of this SLURM job
        ({"job": "778"}, 5.0, False),  # another job, alive
        ({"host": socket.gethostname(), "pid": 2**22 + 17}, 5.0, True),  # dead on this host
        ({"host": socket.gethostname(), "pid": os.getppid()}, 5.0, False),  # alive on this host
    ],
    ids=["other-host-fresh", "other-host-stale", "same-job", "other-job", "dead-pid", "live-pid"],
)
def test_a_free_lock_whose_holder_looks_alive_is_refused(tmp_path, monkeypatch, holder, age, taken):
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    path = _record(tmp_path / "run", age, **holder)
    before = path.read_text()
    if taken:
        lock = RunLock(tmp_path / "run")
        assert json.loads(path.read_text())["pid"] == os.getpid()
        lock.release()
        assert not path.exists()  # a run that ends leaves no lock behind
    else:
        with pytest.raises(RunDirectoryInUse, match="is in use by another run"):
            RunLock(tmp_path / "run")
        assert path.read_text() == before


def test_the_heartbeat_touches_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT", 0.05)
    lock = RunLock(tmp_path)
    first = (tmp_path / LOCK_FILE).stat().st_mtime
    os.utime(tmp_path / LOCK_FILE, (first - 100, first - 100))
    time.sleep(0.3)
    assert (tmp_path / LOCK_FILE).stat().st_mtime > first - 1
    lock.release()


@pytest.mark.slow
def test_a_second_run_on_a_live_run_directory_is_refused_and_touches_nothing(shakespeare, tmp_path):
    """A run trains (paused by SIGSTOP once its first checkpoint is out, so it is surely
    alive); the same command started again (same name) exits 2 in one line naming the live
    run, and the live run, continued, ends with every step logged and its checkpoints
    intact."""
    run_dir = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "t2train.cli",
        "train",
        "--preset",
        "tiny",
        f"data.path={shakespeare}",
        f"log.run_dir={run_dir}",
        "model.num_layers=1",
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.seq_length=64",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "train.steps=40",
        "train.log_interval=1",
        "train.eval_interval=40",
        "checkpoint.interval=10",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    live = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env
    )
    try:
        deadline = time.monotonic() + patient(300)
        while not (run_dir / "checkpoints" / "latest").is_file():
            assert live.poll() is None and time.monotonic() < deadline, live.stdout.read()
            time.sleep(0.1)
        live.send_signal(signal.SIGSTOP)
        metrics = (run_dir / "metrics.jsonl").read_text()
        second = subprocess.run(
            args, capture_output=True, text=True, cwd=REPO, env=env, timeout=300
        )
        live.send_signal(signal.SIGCONT)
        assert second.returncode == 2, second.stdout + second.stderr
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert (
            len(errors) == 1
            and f"is in use by another run (host {socket.gethostname()}, pid {live.pid},"
            in errors[0]
        ), second.stderr
        assert "Traceback" not in second.stderr
        assert (run_dir / "metrics.jsonl").read_text().startswith(metrics)
        output, _ = live.communicate(timeout=600)
    finally:
        if live.poll() is None:
            live.send_signal(signal.SIGCONT)
            live.kill()
            live.wait()
    assert live.returncode == 0, output[-3000:]
    logged = [
        record["step"]
        for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "train/loss" in record
    ]
    assert logged == list(range(1, 41))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000040"
    verify = subprocess.run(
        [
            sys.executable,
            "-m",
            "t2train.cli",
            "ckpt",
            "verify",
            str(run_dir / "checkpoints" / "step_00000010"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_the_launcher_refuses_a_live_run_directory_in_one_line_before_any_worker(
    shakespeare, tmp_path
):
    """``t2train launch`` of two processes on a run directory whose lock a live process
    holds: exit 2 with one ``error:`` line naming the holder, before torch is imported or
    any worker starts (each rank said it, after importing torch and starting a process
    group: 452 s on a loaded machine)."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from t2train.run_lock import RunLock; lock = RunLock(Path(sys.argv[1])); "
            "print('held', flush=True); time.sleep(120)",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        launch = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "t2train.launch", "--nproc-per-node=2"]
            + ["--preset", "tiny", f"data.path={shakespeare}", f"log.run_dir={run_dir}"],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=300,
        )
    finally:
        holder.kill()
        holder.wait()
    lines = [line for line in launch.stderr.splitlines() if not line.startswith("import time:")]
    assert launch.returncode == 2 and launch.stdout == "", launch.stdout + "\n".join(lines)
    assert len(lines) == 1 and lines[0].startswith(
        f"error: run directory {run_dir} is in use by another run (host "
        f"{socket.gethostname()}, pid {holder.pid},"
    ), lines
    imported = {line.split("|")[-1].strip() for line in launch.stderr.splitlines()}
    assert "torch" not in imported, "the refusal came after torch was imported"
    assert os.listdir(run_dir) == [LOCK_FILE]
