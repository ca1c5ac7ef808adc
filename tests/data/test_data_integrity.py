"""A missing, truncated or corrupt shard stops the reader (and `t2train train`) naming the file,
before any of its samples is used: sizes are checked when a split is opened, hashes (recorded
by `data prepare`) when a shard is first read; locally and in a remote dataset's cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from streaming.base.compression import decompress

from t2train.data.errors import DataError
from t2train.data.loader import StreamingWorld, TokenBatches

ONE = StreamingWorld(0, 1, 0, 1)
ZIP, RAW = "shard.00000.mds.zstd", "shard.00000.mds"


def _flip(path: Path, offset: int = 3000) -> None:
    """Invert 64 bytes in place: same size, different content."""
    with open(path, "r+b") as file:
        file.seek(offset)
        data = file.read(64)
        file.seek(offset)
        file.write(bytes(b ^ 0xFF for b in data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _reader(path, **kwargs) -> TokenBatches:
    return TokenBatches(
        path, "train", micro_batch_size=4, seq_length=32, world=ONE, seed=1, **kwargs
    )


@pytest.fixture
def copy(dataset, tmp_path) -> Path:
    """A private copy of the prepared dataset, with its train shard extracted once (as a
    previous run leaves it: the .mds beside the .mds.zstd)."""
    out = tmp_path / "ds"
    shutil.copytree(dataset, out, ignore=shutil.ignore_patterns(RAW))
    next(_reader(out))
    assert (out / "train" / RAW).is_file()
    return out


def test_prepare_records_a_hash_of_every_shard_file(dataset):
    shards = json.loads((dataset / "train" / "index.json").read_text())["shards"]
    for shard in shards:
        for part in ("raw_data", "zip_data"):
            assert set(shard[part]["hashes"]) == {"xxh64"}, shard


# (damage, file, what the error says, refused when the split is opened, before any read)
DAMAGES = [
    ("truncate", ZIP, "bytes, but", True),
    ("truncate", RAW, f"(truncated or corrupt); delete it to extract it again from {ZIP}", True),
    ("delete", ZIP, "missing (listed in", True),
    ("flip", RAW, "xxh64 hash", False),
    # streaming's check while extracting, or ours when the shard is first read
    ("flip-unextracted", ZIP, ("Checksum failure", "xxh64 hash"), False),
]


@pytest.mark.parametrize(
    "damage, name, message, upfront", DAMAGES, ids=[f"{d}-{n}" for d, n, _, _ in DAMAGES]
)
def test_a_damaged_local_shard_is_named(copy, damage, name, message, upfront):
    target = copy / "train" / name
    if damage == "truncate":
        _truncate(target)
    elif damage == "delete":
        target.unlink()
    elif damage == "flip":
        _flip(target)
    else:  # a corrupt archive that streaming has yet to extract
        (copy / "train" / RAW).unlink()
        _flip(target)
    extracted = (copy / "train" / RAW).is_file()
    with pytest.raises(DataError) as err:
        reader = _reader(copy)
        assert not upfront, "should have been refused when the split was opened"
        next(reader)
    text = str(err.value)
    assert f"shard file {copy / 'train' / name}" in text or str(target) in text, text
    assert any(m in text for m in ([message] if isinstance(message, str) else message)), text
    assert "\n" not in text, text
    # streaming deletes an extracted shard whose archive is gone; the check comes first.
    # (A corrupt archive's extraction may or may not have written the raw shard by the time
    # its error arrives: 1 clean-clone run in 4 saw it, so only the deletion is checked.)
    if extracted:
        assert (copy / "train" / RAW).is_file()


def test_a_malformed_shard_index_is_named(copy):
    (copy / "train" / "index.json").write_text('{"shards": [{"raw_data": 3}]}')
    with pytest.raises(DataError, match=r"shard index .*train/index.json: malformed"):
        _reader(copy)


def test_a_corrupt_file_of_a_remote_dataset_or_its_cache_is_named(dataset, tmp_path):
    remote = tmp_path / "remote"
    shutil.copytree(dataset, remote, ignore=shutil.ignore_patterns(RAW))
    cache = tmp_path / "cache"
    next(_reader(cache, remote=str(remote)))  # downloads and extracts into the cache
    _flip(cache / "train" / RAW)
    with pytest.raises(DataError, match=rf"shard file {cache}/train/{RAW}: its xxh64 hash"):
        next(_reader(cache, remote=str(remote)))

    # A fresh cache (the failed reader's download threads may still write into the first).
    fresh = tmp_path / "fresh-cache"
    _flip(remote / "train" / ZIP)  # the download itself is corrupt
    with pytest.raises(DataError, match=rf"Checksum failure: {fresh}/train/{ZIP}"):
        next(_reader(fresh, remote=str(remote)))


def test_a_failed_download_thread_counts_as_exited(dataset, tmp_path):
    """streaming ends a pass by waiting until both of its download threads have exited, and
    counts only normal exits: one that failed on a corrupt shard must count too, or the reader
    waits forever (it did, now and then, instead of naming the file)."""
    from streaming.base.dataset import _Iterator

    remote = tmp_path / "remote"
    shutil.copytree(dataset, remote, ignore=shutil.ignore_patterns(RAW))
    _flip(remote / "train" / ZIP)
    streaming = _reader(tmp_path / "cache", remote=str(remote)).dataset
    streaming._event = threading.Event()  # as a pass sets up its threads
    pass_state = _Iterator(np.arange(4))
    with pytest.raises(DataError, match=rf"Checksum failure: {tmp_path}/cache/train/{ZIP}"):
        streaming._ready_thread(pass_state)  # it prepares the shard itself: not yet local
    assert pass_state._num_exited == 1


# Reads the first batch of each (dataset, workers, how) and prints the error, one JSON line
# each: in its own process, so that a reader waiting forever for a shard is bounded by the
# test's timeout and no state of streaming's outlives it.
_READ_EACH = """
import gc, json, sys
from t2train.data.errors import DataError
from t2train.data.loader import StreamingWorld, TokenBatches
for path, workers, how in json.loads(sys.argv[1]):
    batches = TokenBatches(path, "train", 4, 32, StreamingWorld(0, 1, 0, 1), seed=1,
                           num_workers=workers)
    if how == "after-another-process-failed":
        try:
            batches.dataset.prepare_shard(0)  # as another reader on this host would, first
        except DataError:
            pass
    try:
        next(batches)
        print(json.dumps(None))
    except DataError as err:
        print(json.dumps(str(err)), flush=True)
    del batches
    gc.collect()
"""


@pytest.mark.slow  # DataLoader worker processes in a subprocess: 25 s
def test_errors_in_loader_workers_read_like_errors_in_the_reader(dataset, tmp_path):
    """A corrupt shard read by DataLoader worker processes: the same one-line error as when
    the reader reads it itself, also when the workers would wait for a shard that another
    process failed to extract (which left them waiting forever)."""
    extracted, unextracted = tmp_path / "extracted", tmp_path / "unextracted"
    for copy in (extracted, unextracted):  # copied, not read here (as the copy fixture does):
        # the script's process would map a live reader's shared memory while choosing its
        # own, and its resource tracker unlink it at exit
        shutil.copytree(dataset, copy, ignore=shutil.ignore_patterns(RAW))
    (extracted / "train" / RAW).write_bytes(
        decompress("zstd", (extracted / "train" / ZIP).read_bytes())
    )  # as a run leaves it
    _flip(extracted / "train" / RAW)
    _flip(unextracted / "train" / ZIP)
    runs = [
        (str(extracted), 0, ""),
        (str(extracted), 2, ""),
        (str(unextracted), 0, ""),
        (str(unextracted), 2, "after-another-process-failed"),
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _READ_EACH, json.dumps(runs)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = [json.loads(line) for line in proc.stdout.splitlines()]
    assert errors[0] == errors[1] and errors[2] == errors[3], errors
    assert errors[0].startswith(f"shard file {extracted}/train/{RAW}: its xxh64 hash"), errors
    assert errors[2].startswith(
        f"shard file {unextracted}/train/{RAW} / {unextracted}/train/"
        f"{ZIP}: cannot prepare it (ValueError: Checksum failure"
    ), errors
    assert all("\n" not in error for error in errors)


@pytest.mark.slow
@pytest.mark.parametrize("damage, workers", [("flip", 2), ("truncate", 0)])
def test_train_stops_naming_the_shard_without_a_traceback(copy, tmp_path, damage, workers):
    """`t2train train` on a dataset with a corrupt train shard, read in DataLoader worker
    processes or in the trainer: exit code 2, one error line naming the file, and no step
    trained on it (no checkpoint)."""
    target = copy / "train" / ZIP
    (copy / "train" / RAW).unlink()
    (_flip if damage == "flip" else _truncate)(target)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "t2train.cli",
            "train",
            "--preset",
            "tiny",
            f"data.path={copy}",
            "log.run_dir=runs/x",
            "model.num_layers=2",
            "model.hidden_size=64",
            "model.seq_length=32",
            "train.steps=2",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
            "train.warmup_steps=0",
            "train.eval_batches=1",
            "log.diagnostics_interval=0",
            "log.tensorboard=false",
            f"data.num_workers={workers}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: shard file {target}") or (
        last.startswith("error: shard file ") and str(target) in last
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "runs" / "x" / "checkpoints").exists()
    assert "step      1" not in proc.stdout
