"""Soak test of the preemption path: a run of two nodes with two ranks each is stopped at
random steps, in a random order, by SIGUSR1 and SIGTERM to both node launchers (which pass
them on: the trainers save the step they are in, and the launchers exit 75), by SIGKILL of
one node's launcher (its workers and their helpers die with it, and the run falls back to
its last periodic checkpoint) and by SIGKILL of one rank (a data reader or not), and resumed
each time; the last attempt restarts both nodes within a restart budget. Its final
checkpoint must equal, byte for byte, that of a run never interrupted, and nothing of any
attempt may outlive it. It stands for a week of a real cluster's preemptions.

The order, steps, nodes and ranks come from a seed printed with any failure;
``T2TRAIN_SOAK_SEED=N`` replays one.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
from test_launcher import wait_until_none_left
from tiny_run import TWO_RANK_RUN, TWO_RANK_STEPS

from t2train.signals import REQUEUE_EXIT_CODE

from suite_budget import patient

pytestmark = pytest.mark.slow

STEPS = TWO_RANK_STEPS


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


BOTH_LAUNCHERS = ("SIGUSR1", "SIGTERM")  # as SLURM signals every task of the step
KILL_LAUNCHER, KILL_RANK = "kill -9 of a launcher", "kill -9 of a rank"


def test_a_two_node_run_preempted_and_killed_at_random_ends_as_if_never_interrupted(
    shakespeare, tmp_path, uninterrupted_four_ranks
):
    """Two node launchers (tests/launch/node_launcher.py) of two ranks each (world 4:
    tensor-parallel pairs inside a node, data parallel across) per attempt, stopped at random
    steps, in a random order, by: SIGUSR1 and SIGTERM to both launchers (both save the step
    and exit 75), SIGKILL of one node's launcher (its workers die with it, the other node's
    fails: the next attempt resumes from the last periodic checkpoint) and SIGKILL of one
    rank without a restart budget (the same). The last attempt has a restart budget and one
    of its ranks is killed: both nodes restart within it, the restarted data reader opening
    its data beside what the killed attempt left in shared memory. The node and the rank,
    as the steps, are drawn. The final checkpoint's shards equal, byte for byte, those of
    four ranks never interrupted (conftest.py), every step's loss is equal, and nothing of
    any attempt outlives it."""
    from test_launcher import _start_nodes, _worker

    seed = int(os.environ.get("T2TRAIN_SOAK_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    stops = [*rng.sample([*BOTH_LAUNCHERS, KILL_LAUNCHER, KILL_RANK], 4), KILL_RANK]
    about = f"seed {seed}: {stops}"
    reference_dir, run_dir = uninterrupted_four_ranks.run_dir, tmp_path / "run"
    latest, history, started = run_dir / "checkpoints" / "latest", [], time.monotonic()
    train = [*TWO_RANK_RUN, f"data.path={shakespeare}", f"log.run_dir={run_dir}"]
    nodes = []
    try:
        for attempt, stop in enumerate(stops):
            last = attempt == len(stops) - 1
            resumed = int(latest.read_text().split("_")[1]) if latest.is_file() else 0
            nodes, logs = _start_nodes(
                tmp_path,
                run_dir,
                train,
                restarts=(int(last),) * 2,
                label=f"attempt{attempt}",
                node_env=({"NPROC_PER_NODE": "2"},) * 2,
            )
            target = min(resumed + rng.randint(1, 3), STEPS - 2)
            node = rng.randrange(2)
            rank = 2 * node + rng.randrange(2)
            deadline = time.monotonic() + patient(300)
            while _progress(logs[0]) < target:
                assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline, (
                    f"{about}\n{logs[0].read_text()[-3000:]}"
                )
                time.sleep(0.05)
            if stop in BOTH_LAUNCHERS:
                for launcher in nodes:
                    launcher.send_signal(getattr(signal, stop))
            elif stop == KILL_LAUNCHER:
                nodes[node].send_signal(signal.SIGKILL)
            else:
                _worker(nodes[node], rank=rank).send_signal(signal.SIGKILL)
            codes = [launcher.wait(timeout=300) for launcher in nodes]
            history.append(
                (stop, rank, resumed, _progress(logs[0]), codes, round(time.monotonic() - started))
            )
            if last:
                assert codes == [0, 0], f"{about} {history}\n{logs[0].read_text()[-3000:]}"
            elif stop in BOTH_LAUNCHERS:
                assert codes == [REQUEUE_EXIT_CODE] * 2, f"{about} {history}"
                assert latest.read_text().strip() == f"step_{_progress(logs[0]):08d}", history
            else:  # the run failed; a resubmission resumes it
                assert all(code != 0 for code in codes), f"{about} {history}"
            wait_until_none_left(str(run_dir))
    finally:
        for process in nodes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    print(
        f"two-node soak {about}: (stop, rank, resumed at, stopped at, exit codes, second) {history}"
    )
    final = f"step_{STEPS:08d}"
    assert latest.read_text().strip() == final
    assert _shard_digests(run_dir / "checkpoints" / final) == _shard_digests(
        reference_dir / "checkpoints" / final
    ), f"{about} {history}"
    assert _losses(run_dir) == _losses(reference_dir), f"{about} {history}"
