"""A checkpoint save that fails for real (a directory the OS refuses to change, a file-size
limit hit mid-write) names the path and the OS error, leaves the previous checkpoint published,
and stops the run or trains on as ``checkpoint.on_save_error`` says; with two ranks they agree
(no rank waits forever for the other). A run whose last save failed exits with code 74.

Tests run as root, where permission bits do not stop writes; the faults here are ones root
gets too: the immutable attribute (chattr +i, EPERM) and RLIMIT_FSIZE (EFBIG).
"""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_checkpoint import _config, _engine, _steps

from t2train.errors import TrainingHalted

from torchrun_helper import REPO, child_env


@contextmanager
def immutable(path: Path):
    """The OS refuses any change inside ``path`` (also to root) while the block runs."""
    proc = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"chattr +i unavailable here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@contextmanager
def file_size_limit(limit: int):
    """Writes past ``limit`` bytes fail with EFBIG (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


class FakeMonitor:
    def __init__(self):
        self.lines, self.values, self.closed = [], {}, False

    def print(self, message):
        self.lines.append(message)

    def scalars(self, step, values):
        self.values.setdefault(step, {}).update(values)

    def close(self):
        self.closed = True


def _checkpointer(root: Path, on_save_error: str, monitor=None):
    from t2train.checkpoint.manager import Checkpointer

    config = _config(f"checkpoint.on_save_error={on_save_error}")
    engine = _engine(seed=1, config=config)
    _steps(engine.objs, 1, seed=0)
    saved = []
    return Checkpointer(
        root, config, engine, lambda *args: saved.append(args), monitor=monitor
    ), saved


def _blocker(root: Path, step: int) -> Path:
    """A leftover staging directory of ``step`` holding a file: removing it fails (EPERM)
    once the directory is immutable."""
    staging = root / f"step_{step:08d}.incomplete"
    staging.mkdir(parents=True)
    (staging / "leftover").write_text("x")
    return staging


def test_stop_names_path_and_os_error_and_keeps_the_last_checkpoint(megatron_world, tmp_path: Path):
    root = tmp_path / "checkpoints"
    monitor = FakeMonitor()
    checkpointer, saved = _checkpointer(root, "stop", monitor)
    first = checkpointer.save(1, {"tokens": 1})
    assert first.name == "step_00000001" and len(saved) == 1
    with immutable(root):
        with pytest.raises(TrainingHalted) as err:
            checkpointer.save(2, {"tokens": 2})
    text = str(err.value)
    assert f"checkpoint save of step 2 to {root}/step_00000002.incomplete (" in text, text
    assert "[Errno 1] Operation not permitted" in text and "step_00000002.incomplete" in text
    assert f"the last good checkpoint {first} is intact" in text
    assert "checkpoint.on_save_error=stop" in text and "\n" not in text
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert (first / "metadata.json").is_file() and monitor.closed and len(saved) == 1
    assert (
        not (root / "step_00000002").exists() and not (root / "step_00000002.incomplete").exists()
    )


def test_continue_warns_counts_and_saves_again_later(megatron_world, tmp_path: Path):
    root = tmp_path / "checkpoints"
    monitor = FakeMonitor()
    checkpointer, saved = _checkpointer(root, "continue", monitor)
    first = checkpointer.save(1, {"tokens": 1})
    blocker = _blocker(root, 2)
    with immutable(blocker):
        assert checkpointer.save(2, {"tokens": 2}) == first  # the last published one
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert monitor.values[2] == {"checkpoint/failed_saves": 1}
    warning = next(line for line in monitor.lines if "warning" in line)
    assert f"{blocker}/leftover" in warning and "Operation not permitted" in warning, warning
    assert "training continues" in warning and checkpointer.failed_saves == 1
    third = checkpointer.save(3, {"tokens": 3})  # the disk is fine again
    assert (root / "latest").read_text().strip() == third.name == "step_00000003"
    checkpointer.close()
    assert "1 checkpoint save(s) failed" in monitor.lines[-1] and not monitor.closed


def test_a_write_that_fails_midway_is_caught_and_cleaned_up(megatron_world, tmp_path: Path):
    """The staging directory is fine, but writing the shards hits the file-size limit (EFBIG):
    torch DCP's CheckpointException from the writer, on every rank."""
    root = tmp_path / "checkpoints"
    monitor = FakeMonitor()
    checkpointer, saved = _checkpointer(root, "continue", monitor)
    first = checkpointer.save(1, {"tokens": 1})
    with file_size_limit(100_000):  # above the save's 64 KiB probe, below a shard
        assert checkpointer.save(2, {"tokens": 2}) == first
    warning = next(line for line in monitor.lines if "warning" in line)
    # torch's serializer reports the short write without the errno: a write is tried again
    assert (
        f"failed: OSError: [Errno 27] File too large: '{root}/step_00000002.incomplete' "
        "(a write there fails now; the writer reported rank 0: RuntimeError: Worker "
        "failure"
    ) in warning and "unexpected pos" in warning, warning
    assert f"{root}/step_00000002.incomplete (" in warning and "GiB free there" in warning
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert not (root / "step_00000002.incomplete").exists()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]


@pytest.mark.slow
def test_two_ranks_agree_on_failed_saves_and_a_failed_last_save_is_a_failure(
    shakespeare, tmp_path: Path
):
    """`t2train train` on 2 data-parallel ranks with ``checkpoint.on_save_error=continue``:
    only rank 0 touches the directory and fails (steps 4 and 8); both ranks train on instead
    of one waiting for the other, step 6 is saved, and since the save of step 8, the last,
    failed, the run exits with code 74, not 0. (A failure that one rank sees inside the save
    ends every rank: tests/test_rank_faults.py; ``stop`` on one rank: above.)"""
    from t2train.checkpoint.manager import SAVE_FAILED_EXIT_CODE

    checkpoints = tmp_path / "runs" / "x" / "checkpoints"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "t2train.cli",
        "train",
        "--preset",
        "tiny",
        f"data.path={shakespeare}",
        "log.run_dir=runs/x",
        "model.num_layers=2",
        "model.hidden_size=64",
        "model.seq_length=32",
        "train.steps=8",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.warmup_steps=0",
        "train.eval_batches=1",
        "train.eval_interval=100",
        "log.diagnostics_interval=0",
        "log.tensorboard=false",
        "checkpoint.interval=2",
        "checkpoint.on_save_error=continue",
    ]
    with immutable(_blocker(checkpoints, 4)), immutable(_blocker(checkpoints, 8)):
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=400,
            env=child_env(PYTHONPATH=str(REPO)),
        )
    output = proc.stdout + proc.stderr
    # no trainer traceback (torchrun's agent prints its own when a worker exits non-zero)
    frames = re.findall(r'File "[^"]*/(?:t2train|data|launch)/[^"]*"', proc.stderr)
    assert not frames, output[-4000:]
    assert "warning: checkpoint save of step 4" in proc.stdout
    assert "warning: checkpoint save of step 8" in proc.stdout
    assert "rank 0: PermissionError" in proc.stdout
    # the start cleans what it can and names what it cannot, then trains: a save of the
    # step fails later as any failed save
    assert (
        "could not remove its unfinished save runs/x/checkpoints/step_00000004.incomplete "
        "([Errno 1] Operation not permitted"
    ) in proc.stdout, output[-4000:]
    # torchrun stops a worker still exiting when its peer has exited (SIGTERM, -15); `t2train
    # launch` then reports the worker's own code (test_launcher.py: exit_code)
    codes = re.findall(r"exitcode\s+: (\S+)", output)
    assert str(SAVE_FAILED_EXIT_CODE) in codes and set(codes) <= {"74", "-15"}, output[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: the checkpoint of the last step 8 was not saved (see the warning "
        "above); the newest published checkpoint is "
        "runs/x/checkpoints/step_00000006; exit code 74"
    ], output[-4000:]
    assert (checkpoints / "latest").read_text().strip() == "step_00000006"
    metrics = [
        json.loads(line)
        for line in (tmp_path / "runs" / "x" / "metrics.jsonl").read_text().splitlines()
    ]
    failed = {
        m["step"]: m["checkpoint/failed_saves"] for m in metrics if "checkpoint/failed_saves" in m
    }
    assert failed == {4: 1, 8: 2}, metrics
    assert (checkpoints / "step_00000002" / "metadata.json").is_file()


def test_a_failed_async_save_is_reported_when_it_is_finalized(megatron_world, tmp_path: Path):
    """checkpoint.async_save: the forked writer inherits the file-size limit and fails; the
    failure surfaces when the save is finalized and is handled like a sync one."""
    from t2train.checkpoint.manager import Checkpointer

    root = tmp_path / "checkpoints"
    monitor = FakeMonitor()
    config = _config("checkpoint.on_save_error=continue", "checkpoint.async_save=true")
    engine = _engine(seed=1, config=config)
    _steps(engine.objs, 1, seed=0)
    checkpointer = Checkpointer(root, config, engine, lambda *args: None, monitor=monitor)
    checkpointer.save(1, {"tokens": 1})
    checkpointer.wait()
    with file_size_limit(100_000):
        checkpointer.save(2, {"tokens": 2})  # the writer is forked under the limit
    checkpointer.wait()
    warning = next(line for line in monitor.lines if "warning" in line)
    assert "checkpoint save of step 2" in warning and "Worker failure" in warning, warning
    assert monitor.values[2] == {"checkpoint/failed_saves": 1}
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert not (root / "step_00000002.incomplete").exists()
    checkpointer.save(3, {"tokens": 3})
    checkpointer.close()
    assert (root / "latest").read_text().strip() == "step_00000003"


@contextmanager
def small_tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` mounted at ``path``: writes past it fail with ENOSPC."""
    path.mkdir(parents=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_full_disk_is_named_with_the_os_error_and_the_file(megatron_world, tmp_path: Path):
    """The disk fills while the shards are written (a 256 KiB tmpfs: room for the save's
    64 KiB probe, not for the shards). torch's serializer reports only a short write
    ("unexpected pos"); the one error line names ENOSPC and the file it happened to."""
    with small_tmpfs(tmp_path / "disk", "256k") as disk:
        root = disk / "checkpoints"
        monitor = FakeMonitor()
        checkpointer, saved = _checkpointer(root, "stop", monitor)
        with pytest.raises(TrainingHalted) as err:
            checkpointer.save(1, {"tokens": 1})
        text = str(err.value)
        assert "\n" not in text
        assert (
            f"failed: OSError: [Errno 28] No space left on device: "
            f"'{root}/step_00000001.incomplete' (a write there fails now; the writer "
            "reported rank 0: RuntimeError: Worker failure"
        ) in text, text
        assert not (root / "step_00000001.incomplete").exists() and not saved
