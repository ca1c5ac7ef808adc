"""Fixtures of the data-layer tests: small generated English-ish corpora."""

from __future__ import annotations

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
