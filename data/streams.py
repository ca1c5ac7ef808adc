"""The MDS streams one loader reads: a prepared dataset, or several mixed by proportion.

A prepared dataset is a local directory, or a remote one (any URL mosaicml-streaming
downloads from: s3://, gs://, oci://, azure, hf://, or a plain path on a shared filesystem)
streamed into a local cache directory; the dataset's ``index.json`` is fetched into the cache
first, since it describes the samples. Datasets are mixed only when they are interchangeable
token streams: the same tokenizer (by sha256) and samples long enough for the run.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from streaming import Stream
from streaming.base.storage import CloudDownloader

from t2train.data.errors import DataError
from t2train.data.index import INDEX_FILE, read_index


@dataclass(frozen=True)
class DataStream:
    """One prepared dataset of a loader.

    ``path`` is the dataset directory, or with ``remote`` (the dataset's URL) the local cache
    it is streamed into (one cache per remote dataset). ``proportion`` is the dataset's
    relative share of each epoch's samples when several are mixed (up- or down-sampled to
    match); None for every stream reads each dataset once per epoch.
    """

    path: str | Path
    remote: Optional[str] = None
    proportion: Optional[float] = None


def unpacked_elsewhere(
    dataset: str | Path, cache_dir: str | Path, proportion: Optional[float] = None
) -> DataStream:
    """A local prepared dataset read through a cache: its shards are copied and unpacked into
    ``cache_dir`` (for example node-local scratch) instead of beside themselves, and the
    dataset directory is only read. Each version of a dataset gets its own subfolder, named
    after the dataset and the hash of its ``index.json``, so a dataset prepared again never
    meets the shards of the old one."""
    index = Path(dataset) / INDEX_FILE
    read_index(dataset)  # a clear error for a directory that is not a prepared dataset
    version = hashlib.sha256(index.read_bytes()).hexdigest()[:12]
    name = Path(dataset).resolve().name
    return DataStream(
        Path(cache_dir) / f"{name}-{version}", str(Path(dataset).resolve()), proportion
    )


def split_streams(streams: Sequence[DataStream], split: str, seq_length: int) -> list[Stream]:
    """mosaicml-streaming ``Stream``s of ``split`` of each dataset, checked to be mixable."""
    if not streams:
        raise ValueError("no datasets: give at least one DataStream")
    weighted = [s.proportion is not None for s in streams]
    if any(weighted) and not all(weighted):
        raise DataError(
            f"proportions {[s.proportion for s in streams]}: give every mixed "
            "dataset a proportion, or none"
        )
    locals_ = [Path(s.path).resolve() for s in streams]
    if len(set(locals_)) != len(locals_):
        raise DataError(
            f"datasets {[str(s.path) for s in streams]}: each dataset (or remote "
            "cache) directory may appear only once"
        )
    first = None
    result = []
    for stream in streams:
        if stream.proportion is not None and not stream.proportion > 0:
            raise DataError(f"dataset {stream.path}: proportion={stream.proportion}, must be > 0")
        index = _index(stream)
        _check_split(stream.path, index, split, seq_length)
        first = first or (stream.path, index)
        if index["tokenizer"]["sha256"] != first[1]["tokenizer"]["sha256"]:
            raise DataError(
                f"dataset {stream.path}: its tokenizer (sha256 "
                f"{index['tokenizer']['sha256'][:12]}) differs from that of "
                f"{first[0]} ({first[1]['tokenizer']['sha256'][:12]}); mixed datasets "
                "must be prepared with the same tokenizer.json (--tokenizer)"
            )
        if stream.remote and Path(stream.remote).is_dir():  # a source on this filesystem
            check_shard_files(DataStream(stream.remote), split)
        hashed = check_shard_files(stream, split)
        result.append(
            Stream(
                local=str(Path(stream.path) / split),
                remote=f"{stream.remote.rstrip('/')}/{split}" if stream.remote else None,
                proportion=stream.proportion,
                # streaming checks each file it downloads or decompresses
                validate_hash=hashed,
            )
        )
    return result


def check_shard_files(stream: DataStream, split: str) -> Optional[str]:
    """Refuse a split whose shard files are missing or have the wrong size, naming the file.

    Runs before mosaicml-streaming opens the split (which would silently delete an extracted
    shard whose compressed file is gone, and fail later in a background thread). Only sizes
    are checked here (a ``stat`` per file); each file's hash, when the index records one, is
    checked when a reader first uses the shard (``loader.py``). Files of a remote dataset that
    are not in the local cache yet are downloaded (and hash-checked) by streaming. Returns the
    hash algorithm the split's index records for every file, or None.
    """
    split_dir = Path(stream.path) / split
    index_file = split_dir / "index.json"
    if stream.remote:  # what streaming would fetch first anyway
        _fetch(f"{stream.remote.rstrip('/')}/{split}/index.json", index_file)
    if not index_file.is_file():
        raise DataError(
            f"dataset {stream.path}: shard index {index_file} is missing; prepare "
            "the dataset again (`t2train data prepare`)"
        )
    try:
        shards = json.loads(index_file.read_text())["shards"]
        pairs = [(shard["raw_data"], shard.get("zip_data")) for shard in shards]
        for raw, zipped in pairs:
            for info in (raw, zipped):
                if info is not None and not (
                    isinstance(info["basename"], str) and isinstance(info["bytes"], int)
                ):
                    raise TypeError("basename or bytes of wrong type")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
        raise DataError(
            f"shard index {index_file}: malformed ({type(err).__name__}: {err}); "
            "prepare the dataset again (`t2train data prepare`)"
        ) from None
    fix = (
        "delete it from the cache to download it again"
        if stream.remote
        else "prepare the dataset again (`t2train data prepare`)"
    )
    algorithms = []
    for raw, zipped in pairs:
        for info in (zipped, raw):
            if info is None:
                continue
            algorithms.append(set(info.get("hashes") or ()))
            file = split_dir / info["basename"]
            if file.is_file() and file.stat().st_size != info["bytes"]:
                extracted = zipped is not None and info is raw
                raise DataError(
                    f"shard file {file}: {file.stat().st_size} bytes, but {index_file} records "
                    f"{info['bytes']} (truncated or corrupt); "
                    + (
                        f"delete it to extract it again from {zipped['basename']}"
                        if extracted and not stream.remote
                        else fix
                    )
                )
        source = split_dir / (zipped or raw)["basename"]
        if not stream.remote and not source.is_file():
            raise DataError(f"shard file {source}: missing (listed in {index_file}); {fix}")
    from streaming.base.hashing import is_hash  # noqa: PLC0415 - mosaicml-streaming: only when shards are checked

    common = set.intersection(*algorithms) if algorithms else set()
    usable = sorted(algo for algo in common if is_hash(algo))
    return usable[0] if usable else None


def _check_split(path, index: dict, split: str, seq_length: int) -> None:
    if split not in index["splits"]:
        raise DataError(f"dataset {path}: no split {split!r} (has {', '.join(index['splits'])})")
    if seq_length > index["seq_length"]:
        raise DataError(
            f"seq_length={seq_length}: needs samples of {seq_length + 1} tokens, "
            f"but the samples of {path} have {index['seq_length'] + 1} tokens "
            f"(prepared with seq_length={index['seq_length']})"
        )


def _index(stream: DataStream) -> dict:
    if stream.remote:
        _fetch(f"{stream.remote.rstrip('/')}/{INDEX_FILE}", Path(stream.path) / INDEX_FILE)
    return read_index(stream.path)


def _fetch(remote: str, local: Path) -> None:
    """Download ``remote`` to ``local`` once; atomically, as several readers may share a cache."""
    if local.is_file():
        return
    local.parent.mkdir(parents=True, exist_ok=True)
    partial = local.with_name(f".{local.name}.{os.getpid()}.partial")
    try:
        CloudDownloader.direct_download(remote, str(partial))
    except Exception as err:  # each storage client raises its own errors
        partial.unlink(missing_ok=True)
        raise DataError(
            f"remote dataset file {remote}: could not download it into the cache "
            f"{local.parent} ({type(err).__name__}: {err})"
        ) from None
    os.replace(partial, local)
