"""Fixtures of the launcher tests: SLURM installed and configured, a live local cluster, and
the uninterrupted runs (two and four ranks) that interrupted runs are compared with (the
prepared dataset is ``shakespeare`` from tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock
from local_slurm import LocalSlurm, install_reason
from tiny_run import TWO_RANK_RUN

REPO = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config, items):
    """Tests that use SLURM (installed on first use) are marked ``slurm``: not in the fast tier."""
    for item in items:
        if "slurm_conf" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)


@pytest.fixture(scope="session")
def slurm_conf(tmp_path_factory):
    """SLURM installed (apt-get when missing) and a cluster config in SLURM_CONF.

    Enough for client-side commands such as ``scontrol show hostnames``; no daemon runs.
    """
    reason = install_reason()
    if reason:
        pytest.skip(f"SLURM unavailable: {reason}")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    cluster.write_config()
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    yield cluster
    if saved is None:
        os.environ.pop("SLURM_CONF")
    else:
        os.environ["SLURM_CONF"] = saved


@pytest.fixture(scope="session")
def slurm_cluster(slurm_conf) -> LocalSlurm:
    """munged, slurmctld and two slurmd (nodes n1, n2) on this host, stopped afterwards."""
    try:
        slurm_conf.start()
        yield slurm_conf
    finally:
        slurm_conf.stop()


@dataclass(frozen=True)
class UninterruptedRun:
    run_dir: Path
    stdout: str
    stderr: str
    returncode: int


def _shared_run(shakespeare, tmp_path_factory, nproc: int) -> UninterruptedRun:
    """``t2train launch --nproc-per-node=NPROC`` of ``TWO_RANK_RUN``, never interrupted,
    trained once per suite run: the pytest workers share it through a lock in their common
    temporary folder (pytest-xdist's recipe). Its environment lacks OMP_NUM_THREADS, so that
    torchrun's banner about it would show."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    name = f"uninterrupted-{nproc}-ranks"
    folder, done = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
            env.pop("OMP_NUM_THREADS", None)
            run_dir = folder / "run"
            proc = subprocess.run(
                [sys.executable, "-m", "t2train.launch", f"--nproc-per-node={nproc}"]
                + [*TWO_RANK_RUN, f"data.path={shakespeare}", f"log.run_dir={run_dir}"],
                capture_output=True,
                text=True,
                env=dict(env, PYTHONUNBUFFERED="1"),
                cwd=REPO,
                timeout=600,
            )
            done.write_text(
                json.dumps(
                    {
                        "run_dir": str(run_dir),
                        "stdout": proc.stdout,
                        "stderr": proc.stderr,
                        "returncode": proc.returncode,
                    }
                )
            )
    run = json.loads(done.read_text())
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    return UninterruptedRun(Path(run.pop("run_dir")), **run)


@pytest.fixture(scope="session")
def uninterrupted(shakespeare, tmp_path_factory) -> UninterruptedRun:
    """The reference of every test that stops, kills or restarts the two-rank run: two ranks
    on one node or one on each of two nodes train alike."""
    return _shared_run(shakespeare, tmp_path_factory, nproc=2)


@pytest.fixture(scope="session")
def uninterrupted_four_ranks(shakespeare, tmp_path_factory) -> UninterruptedRun:
    """The same run on four ranks (tensor-parallel pairs, two data-parallel replicas): the
    reference of the runs of two nodes with two ranks each."""
    return _shared_run(shakespeare, tmp_path_factory, nproc=4)
