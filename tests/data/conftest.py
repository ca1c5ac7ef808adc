"""Fixtures of the data-layer tests: small generated English-ish corpora, isolated streaming."""

from __future__ import annotations

import gc
import os
import re
import tempfile
from pathlib import Path

import pytest
from textgen import english_ish


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
    prepare_dataset([str(folder / "*.txt")], out, seq_length=32, vocab_size=400,
                    val_fraction=0.1)
    return out


@pytest.fixture(scope="session", autouse=True)
def isolated_streaming(tmp_path_factory):
    """Keep streaming's never-deleted filelocks out of /tmp, and its shared memory tidy.

    streaming puts ``<prefix>_*_filelock`` files in ``tempfile.gettempdir()`` (also in spawned
    children, hence TMPDIR) and segments in /dev/shm; segments this session created and left
    behind are removed at the end.
    """
    scratch = str(tmp_path_factory.mktemp("streaming-tmp"))
    before = set(os.listdir("/dev/shm"))
    saved_tempdir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = scratch
    yield
    tempfile.tempdir = saved_tempdir
    if saved_env is None:
        os.environ.pop("TMPDIR")
    else:
        os.environ["TMPDIR"] = saved_env
    gc.collect()
    for name in set(os.listdir("/dev/shm")) - before:
        if re.fullmatch(r"\d{6}_\w+", name):
            Path("/dev/shm", name).unlink(missing_ok=True)
