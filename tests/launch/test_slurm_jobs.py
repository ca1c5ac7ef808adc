"""The project's real ``slurm/pretrain.sbatch`` on a real SLURM (local cluster, 2 nodes).

CPU overrides: ``--gpus-per-node=0`` and ``NPROC_PER_NODE=2``, so each simulated node runs
the launcher under srun and two torchrun workers: a world of 4 with ``parallel.tensor=2``
(tensor-parallel pairs inside a node, data parallelism across the two nodes).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from tiny_run import TINY_MODEL

from proc_signals import has, signal_masks
from suite_budget import patient

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "pretrain.sbatch"
STEPS = 30
TRAIN = [
    *TINY_MODEL,
    "parallel.tensor=2",
    f"train.steps={STEPS}",
    f"train.eval_interval={STEPS}",
    f"checkpoint.interval={STEPS}",
]
JOB_TIMEOUT = 300


def _submit(cluster, data: Path, out: Path, name: str, *extra: str) -> tuple[str, Path]:
    log = out / f"{name}.out"
    job = cluster.sbatch(
        "--nodes=2",
        "--gpus-per-node=0",
        f"--job-name={name}",
        f"--output={log}",
        f"--error={log}",
        f"--chdir={out}",
        str(SBATCH),
        f"name={name}",
        *TRAIN,
        *extra,
        env={
            "DATA": str(data),
            "PRESET": "",
            "NPROC_PER_NODE": "2",
            "OUTPUT_DIR": str(out / "runs"),
            "T2TRAIN": str(Path(sys.executable).parent / "t2train"),
            "PYTHONUNBUFFERED": "1",
        },
    )
    return job, log


def _done(fields: dict) -> bool:
    return (
        fields.get("JobState")
        in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
        or not fields
    )


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in _metrics(run_dir) if "train/loss" in r}


@pytest.fixture(scope="module")
def reference(slurm_cluster, shakespeare, tmp_path_factory) -> dict:
    """One uninterrupted 2-node job: its log, final state and per-step losses."""
    out = tmp_path_factory.mktemp("reference")
    started = time.monotonic()
    job, log = _submit(slurm_cluster, shakespeare, out, "reference")
    fields = slurm_cluster.wait_job(job, _done, JOB_TIMEOUT, log)
    return {
        "job": job,
        "fields": fields,
        "log": log.read_text(),
        "run_dir": out / "runs" / "reference",
        "seconds": time.monotonic() - started,
    }


def test_two_node_job_trains_under_srun_and_torchrun(reference):
    log, job = reference["log"], reference["job"]
    assert reference["fields"]["JobState"] == "COMPLETED", log[-6000:]
    for rank, node in enumerate(("n1", "n2")):
        assert (
            f"t2train launch: SLURM job {job} (restart 0) | 2 node(s) n1,n2 | node rank "
            f"{rank} on {node} | 2 process(es) per node | world size 4 | c10d rendezvous "
            f"127.0.0.1:"
        ) in log, log[-6000:]
    assert "TP 2 x PP 1 x DP 2" in log
    val = {r["step"]: r["val/loss"] for r in _metrics(reference["run_dir"]) if "val/loss" in r}
    assert val[STEPS] < val[0] - 0.5, val
    losses = _losses(reference["run_dir"])
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert sum(list(losses.values())[-5:]) < sum(list(losses.values())[:5])


def _latest(run_dir: Path) -> int:
    marker = run_dir / "checkpoints" / "latest"
    return int(marker.read_text().strip().split("_")[1]) if marker.is_file() else 0


def _wait_for(condition, job: str, cluster, log: Path) -> None:
    deadline = time.monotonic() + patient(JOB_TIMEOUT)
    while not condition():
        fields = cluster.job(job)
        assert time.monotonic() < deadline and not _done(fields), (
            log.read_text()[-6000:] if log.is_file() else "no log"
        ) + f"\njob: {fields}"
        time.sleep(0.2)


def _trainers(job: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if "t2train.cli" in process.cmdline() and process.environ().get("SLURM_JOB_ID") == job:
                found.append(process)
        except psutil.Error:  # ended, or another user's
            continue
    return found


@contextmanager
def _paused_until_pending(job: str, signum: int, trainers: int = 4):
    """The job's trainers stopped (SIGSTOP) until each holds ``signum`` pending, then
    continued: a signal sent meanwhile reaches them before their next step, however long
    SLURM takes to pass it on. A tiny model trains a step in 0.2 s and the USR1 once took
    1.5 s from ``scancel`` to the trainers, so the stop landed on the periodic save's step."""
    paused = _trainers(job)
    assert len(paused) == trainers, [p.cmdline() for p in paused]
    for process in paused:
        process.suspend()
    try:
        yield
        deadline = time.monotonic() + patient(60)
        while not all(
            has(masks["SigPnd"] | masks["ShdPnd"], signum)
            for masks in (signal_masks(p.pid) for p in paused)
        ):
            assert time.monotonic() < deadline, "the signal did not reach every trainer"
            time.sleep(0.05)
    finally:
        for process in paused:
            process.resume()


def test_usr1_requeues_and_scancel_saves_and_both_resume_with_the_same_losses(
    slurm_cluster, shakespeare, tmp_path, reference
):
    """One run, stopped twice. USR1 to the batch script (SLURM's warning before the time
    limit): the trainers save, the job requeues itself and resumes. Then a plain ``scancel``,
    which sends SIGTERM to every process of the job step (launchers, trainers, the checkpoint
    writers started by the resumed run's step-10 save) and SIGKILL after KillWait (30 s):
    the step being trained is saved in time, and a new job resumes from it. The losses of
    all three parts equal the uninterrupted run's, bitwise."""
    saves = "checkpoint.interval=10"  # the resumed run saves before scancel: writers exist
    job, log = _submit(slurm_cluster, shakespeare, tmp_path, "preempted", saves)
    run_dir = tmp_path / "runs" / "preempted"
    _wait_for(lambda: len(_losses(run_dir)) >= 3, job, slurm_cluster, log)
    with _paused_until_pending(job, signal.SIGUSR1):
        paused_after = max(_losses(run_dir))
        subprocess.run(
            ["scancel", "--signal=USR1", "--batch", job],
            check=True,
            env=slurm_cluster.env,
            timeout=60,
        )

    # The job requeues itself; SLURM holds a requeued job ~2 min (BeginTime): release it a few
    # seconds on. Not at once: the requeue revokes the job's credential with a timestamp in
    # seconds, and slurmd refuses a launch in that same second ("Job credential revoked"),
    # which fails the job.
    slurm_cluster.wait_job(
        job, lambda f: f.get("Restarts") == "1" and f.get("JobState") == "PENDING", JOB_TIMEOUT, log
    )
    subprocess.run(
        ["scontrol", "update", f"JobId={job}", "StartTime=now+3"],
        check=True,
        env=slurm_cluster.env,
        timeout=60,
    )
    text = log.read_text()
    stopped = int(text.split("| stopping early: received SIGUSR1")[0].rsplit("step", 1)[1])
    # the last step logged when the trainers were paused, or a step in flight then (rank 0
    # logs a step's loss after the step; its peers may have begun the next)
    assert paused_after <= stopped <= paused_after + 2 < 10, (paused_after, stopped)
    assert _latest(run_dir) == stopped
    assert f"job {job}: checkpoint saved, requeueing" in text

    _wait_for(
        lambda: _latest(run_dir) >= 10 and max(_losses(run_dir)) > _latest(run_dir),
        job,
        slurm_cluster,
        log,
    )
    subprocess.run(["scancel", job], check=True, env=slurm_cluster.env, timeout=60)
    cancelled = time.monotonic()
    # Trained before scancel returned; SLURM forwards the signal a moment later, and on a
    # loaded machine a tiny model trains a step or two more in that moment.
    running = max(_losses(run_dir))
    published = {}  # checkpoint step -> seconds after scancel when `latest` first named it
    while True:
        ended = _done(slurm_cluster.job(job)) and not slurm_cluster.busy_nodes()
        published.setdefault(_latest(run_dir), time.monotonic() - cancelled)
        if ended or time.monotonic() > cancelled + 90:
            break
        time.sleep(0.2)
    text = log.read_text()
    assert slurm_cluster.job(job).get("JobState") == "CANCELLED", text[-6000:]
    cancel_step = _latest(run_dir)
    # The step trained when SIGTERM arrived is the one saved: none trained is lost, none
    # trained after the save.
    assert cancel_step >= running, (running, cancel_step, text[-6000:])
    assert f"step {cancel_step:>6} | stopping early: received SIGTERM" in text, text[-6000:]
    assert sorted(_losses(run_dir)) == list(range(1, cancel_step + 1))
    assert not list((run_dir / "checkpoints").glob("*.incomplete")), text[-6000:]
    print(f"scancel: step {cancel_step} published {published[cancel_step]:.1f}s after it")
    assert published[cancel_step] < 30  # KillWait

    job2, _ = _submit(slurm_cluster, shakespeare, tmp_path, "preempted", saves)
    fields = slurm_cluster.wait_job(job2, _done, JOB_TIMEOUT, log)
    text = log.read_text()
    assert fields.get("JobState") == "COMPLETED", f"{fields}\n{text[-6000:]}"
    assert f"SLURM job {job} (restart 1)" in text
    assert f"resumed from {run_dir}/checkpoints/step_{stopped:08d}" in text
    assert f"resumed from {run_dir}/checkpoints/step_{cancel_step:08d}" in text
    resumed, uninterrupted = _losses(run_dir), _losses(reference["run_dir"])
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == uninterrupted  # bitwise: same data order, RNG and optimizer state
