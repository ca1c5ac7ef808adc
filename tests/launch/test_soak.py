"""Soak test of the preemption path: one run is stopped three times at random steps, by SIGUSR1
and SIGTERM to its launcher (which passes them on: the trainer saves the step it is in, and
the launcher exits 75) and by SIGKILL of the launcher itself (the
workers and their helpers die with it, and the run falls back to its last periodic
checkpoint), in a random order, and resumed each time. Its final checkpoint must equal, byte
for byte, that of a run never interrupted, and nothing of any attempt may outlive it. It
stands for a week of a real cluster's preemptions.

The order and steps come from a seed printed with any failure; ``T2TRAIN_SOAK_SEED=N``
replays one.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_launcher import REPO, RUN_TAG, _env, _launch_cmd, wait_until_none_left
from tiny_run import TINY_MODEL

from t2train.signals import REQUEUE_EXIT_CODE

pytestmark = pytest.mark.slow

STEPS = 12
TRAIN = [*TINY_MODEL, f"train.steps={STEPS}", f"train.eval_interval={STEPS}",
         "train.eval_batches=1", "checkpoint.interval=3", "log.diagnostics_interval=0",
         "log.tensorboard=false"]


def _progress(log: Path) -> int:
    """The last step this attempt trained (its own console, not the run's metrics)."""
    steps = re.findall(r"^step\s+(\d+)/\d+ \| loss", log.read_text(), re.M)
    return int(steps[-1]) if steps else 0


def _shard_digests(checkpoint: Path) -> dict:
    """The recorded checksums of the model, optimizer and RNG shards (common.pt also holds
    timings and counters of the attempts)."""
    files = json.loads((checkpoint / "t2train_checksums.json").read_text())["files"]
    return {name: entry for name, entry in files.items() if name.endswith(".distcp")}


def _losses(run_dir: Path) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def test_a_run_preempted_at_random_steps_ends_as_if_never_interrupted(shakespeare, tmp_path):
    seed = int(os.environ.get("T2TRAIN_SOAK_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    stops = rng.sample([signal.SIGUSR1, signal.SIGTERM, signal.SIGKILL], 3)
    about = f"seed {seed}: {[s.name for s in stops]}"
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    reference = subprocess.Popen(  # trains beside the first attempt
        [sys.executable, "-m", "t2train.cli", "train", *TRAIN, f"data.path={shakespeare}",
         f"log.run_dir={reference_dir}"], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    env = dict(_env(), **{RUN_TAG: str(run_dir)})
    latest, history, started = run_dir / "checkpoints" / "latest", [], time.monotonic()
    try:
        for attempt, stop in enumerate([*stops, None]):
            log = tmp_path / f"attempt{attempt}.log"
            resumed = int(latest.read_text().split("_")[1]) if latest.is_file() else 0
            with log.open("w") as out:
                launcher = subprocess.Popen(
                    _launch_cmd("--nproc-per-node=1", *TRAIN, f"data.path={shakespeare}",
                                f"log.run_dir={run_dir}"),
                    stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                    start_new_session=True)
            if stop is not None:
                target = min(resumed + rng.randint(1, 4), STEPS - 2)
                deadline = time.monotonic() + 300
                while _progress(log) < target:
                    assert launcher.poll() is None and time.monotonic() < deadline, \
                        f"{about}\n{log.read_text()[-3000:]}"
                    time.sleep(0.05)
                launcher.send_signal(stop)
            code = launcher.wait(timeout=300)
            history.append((stop and stop.name, resumed, _progress(log), code,
                            round(time.monotonic() - started)))
            expected = {None: 0, signal.SIGKILL: -signal.SIGKILL}.get(stop, REQUEUE_EXIT_CODE)
            assert code == expected, f"{about} {history}\n{log.read_text()[-3000:]}"
            if stop == signal.SIGKILL:  # nothing was left to end the workers but themselves
                wait_until_none_left(str(run_dir))
            elif stop is not None:  # the launcher passed the signal on: the step was saved
                stopped, output = _progress(log), log.read_text()
                assert latest.read_text().strip() == f"step_{stopped:08d}", history
                assert f"step {stopped:>6} | stopping early: received {stop.name}" in output
                assert "training saved a checkpoint and stopped early" in output, output[-3000:]
        assert reference.wait(timeout=300) == 0, reference.stderr.read()[-3000:]
    finally:
        for process in (reference, launcher):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL) if process is launcher else process.kill()
    print(f"soak {about}: (signal, resumed at, stopped at, exit code, second) {history}")
    final = f"step_{STEPS:08d}"
    assert latest.read_text().strip() == final
    assert _shard_digests(run_dir / "checkpoints" / final) == \
        _shard_digests(reference_dir / "checkpoints" / final), f"{about} {history}"
    assert _losses(run_dir) == _losses(reference_dir), f"{about} {history}"
    wait_until_none_left(str(run_dir))


TWO_NODES = [*TRAIN, "parallel.tensor=2"]  # one process on each of two nodes
BOTH_LAUNCHERS = ("SIGUSR1", "SIGTERM")  # as SLURM signals every task of the step
KILL_LAUNCHER, KILL_RANK = "kill -9 of a launcher", "kill -9 of a rank"


def test_a_two_node_run_preempted_and_killed_at_random_ends_as_if_never_interrupted(
        shakespeare, tmp_path):
    """Two node launchers (tests/launch/node_launcher.py) per attempt, stopped at random
    steps, in a random order, by: SIGUSR1 and SIGTERM to both launchers (both save the step
    and exit 75), SIGKILL of one node's launcher (its worker dies with it, the other node's
    fails: the next attempt resumes from the last periodic checkpoint) and SIGKILL of one
    rank without a restart budget (the same). The last attempt has a restart budget and one
    of its ranks is killed: both nodes restart within it. The node, as the steps, is drawn.
    The final checkpoint's shards equal, byte for byte, those of an uninterrupted two-node run,
    every step's loss is equal, and nothing of any attempt outlives it."""
    from test_launcher import _start_nodes, _worker

    seed = int(os.environ.get("T2TRAIN_SOAK_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    stops = [*rng.sample([*BOTH_LAUNCHERS, KILL_LAUNCHER, KILL_RANK], 4), KILL_RANK]
    about = f"seed {seed}: {stops}"
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    reference, _ = _start_nodes(tmp_path, reference_dir,
                                [*TWO_NODES, f"data.path={shakespeare}",
                                 f"log.run_dir={reference_dir}"], label="reference")
    latest, history, started = run_dir / "checkpoints" / "latest", [], time.monotonic()
    train = [*TWO_NODES, f"data.path={shakespeare}", f"log.run_dir={run_dir}"]
    nodes = []
    try:
        for attempt, stop in enumerate(stops):
            last = attempt == len(stops) - 1
            resumed = int(latest.read_text().split("_")[1]) if latest.is_file() else 0
            nodes, logs = _start_nodes(tmp_path, run_dir, train, restarts=(int(last),) * 2,
                                       label=f"attempt{attempt}")
            target = min(resumed + rng.randint(1, 3), STEPS - 2)
            node = rng.randrange(2)
            deadline = time.monotonic() + 300
            while _progress(logs[0]) < target:
                assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline, \
                    f"{about}\n{logs[0].read_text()[-3000:]}"
                time.sleep(0.05)
            if stop in BOTH_LAUNCHERS:
                for launcher in nodes:
                    launcher.send_signal(getattr(signal, stop))
            elif stop == KILL_LAUNCHER:
                nodes[node].send_signal(signal.SIGKILL)
            else:
                _worker(nodes[node], rank=node).send_signal(signal.SIGKILL)
            codes = [launcher.wait(timeout=300) for launcher in nodes]
            history.append((stop, node, resumed, _progress(logs[0]), codes,
                            round(time.monotonic() - started)))
            if last:
                assert codes == [0, 0], f"{about} {history}\n{logs[0].read_text()[-3000:]}"
            elif stop in BOTH_LAUNCHERS:
                assert codes == [REQUEUE_EXIT_CODE] * 2, f"{about} {history}"
                assert latest.read_text().strip() == f"step_{_progress(logs[0]):08d}", history
            else:  # the run failed; a resubmission resumes it
                assert all(code != 0 for code in codes), f"{about} {history}"
            wait_until_none_left(str(run_dir))
        assert [launcher.wait(timeout=300) for launcher in reference] == [0, 0]
    finally:
        for process in [*reference, *nodes]:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    print(f"two-node soak {about}: (stop, node, resumed at, stopped at, exit codes, second) "
          f"{history}")
    final = f"step_{STEPS:08d}"
    assert latest.read_text().strip() == final
    assert _shard_digests(run_dir / "checkpoints" / final) == \
        _shard_digests(reference_dir / "checkpoints" / final), f"{about} {history}"
    assert _losses(run_dir) == _losses(reference_dir), f"{about} {history}"
