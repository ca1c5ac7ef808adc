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
