"""Fixtures of the data-layer tests: small generated English-ish corpora, and a /dev/shm of
its own for a test that must be the only streaming user of its host."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from textgen import english_ish

INSIDE_OWN_DEV_SHM = "T2TRAIN_TEST_OWN_DEV_SHM"
# A private mount namespace with a fresh tmpfs on /dev/shm: as on a host of its own.
OWN_DEV_SHM = [
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "sh",
    "-c",
    'mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm && exec "$@"',
    "sh",
]


def _own_dev_shm_works() -> bool:
    try:
        probe = subprocess.run([*OWN_DEV_SHM, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked ``own_dev_shm`` runs in a pytest of its own with a private /dev/shm:
    what it asserts about the host's streaming segments (which files a cleaning removes)
    must not see another test worker's readers, which map other prefixes' segments while
    choosing their own. Without ``unshare`` (not root) it runs here, alone or not."""
    if not pyfuncitem.get_closest_marker("own_dev_shm") or os.environ.get(INSIDE_OWN_DEV_SHM):
        return None
    if not _own_dev_shm_works():
        return None
    proc = subprocess.run(
        [*OWN_DEV_SHM, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["-p", "no:xdist", pyfuncitem.nodeid],
        cwd=pyfuncitem.config.rootpath,
        env=dict(os.environ, **{INSIDE_OWN_DEV_SHM: "1"}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return True


@pytest.fixture
def text_files(tmp_path) -> list[Path]:
    """Three plain-text documents of ~10 KB each."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    files = []
    for i in range(3):
        path = folder / f"doc{i}.txt"
        path.write_text(english_ish(seed=i, paragraphs=40))
        files.append(path)
    return files


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    """A prepared dataset (seq_length 32, vocab 400) shared read-only by the loader tests."""
    from t2train.data.prepare import prepare_dataset

    folder = tmp_path_factory.mktemp("corpus")
    for i in range(4):
        (folder / f"doc{i}.txt").write_text(english_ish(seed=10 + i, paragraphs=60))
    out = tmp_path_factory.mktemp("dataset") / "ds"
    prepare_dataset([str(folder / "*.txt")], out, seq_length=32, vocab_size=400, val_fraction=0.1)
    return out


@pytest.fixture(scope="session")
def mix_datasets(tmp_path_factory, dataset) -> tuple[Path, Path]:
    """Two datasets of short samples (seq_length 8) with ``dataset``'s tokenizer, the first
    about four times larger than the second, for mixing."""
    from t2train.data.prepare import prepare_dataset

    root = tmp_path_factory.mktemp("mix")
    out = []
    for name, docs in (("big", 16), ("small", 4)):
        for i in range(docs):
            (root / f"{name}{i}.txt").write_text(
                english_ish(seed=1000 * len(out) + i, paragraphs=200)
            )
        prepare_dataset(
            [str(root / f"{name}*.txt")],
            root / name,
            seq_length=8,
            tokenizer=dataset / "tokenizer.json",
            val_fraction=0.01,
        )
        out.append(root / name)
    return out[0], out[1]
