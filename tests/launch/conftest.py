"""Fixtures of the launcher tests: SLURM installed and configured, and a live local cluster
(the prepared dataset is ``shakespeare`` from tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
from local_slurm import LocalSlurm, install_reason


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
