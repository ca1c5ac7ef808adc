"""Fixtures of the launcher tests: SLURM installed and configured, a live local cluster,
and a small prepared Shakespeare dataset."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from local_slurm import LocalSlurm, install_reason

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


@pytest.fixture(scope="session")
def hamlet(tmp_path_factory) -> Path:
    """Hamlet (two editions) as 64-token samples with a 1k BPE: prepared in seconds."""
    from t2train.data.cli import default_cache_dir
    from t2train.data.corpora import fetch_corpus
    from t2train.data.errors import DataError
    from t2train.data.prepare import prepare_dataset

    try:
        files = fetch_corpus("shakespeare", default_cache_dir())
    except DataError as err:
        pytest.skip(f"Shakespeare corpus unavailable: {err}")
    out = tmp_path_factory.mktemp("hamlet") / "bpe1k-s64"
    prepare_dataset([str(f) for f in files if f.name.startswith("hamlet")], out,
                    seq_length=64, vocab_size=1024, val_fraction=0.05)
    return out
