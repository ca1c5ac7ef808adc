"""Turn input files into a prepared dataset: MDS shards of fixed-length token samples.

Layout of ``out_dir`` (what ``t2train train data.path=...`` reads)::

    index.json       what was built from what (see ``prepare_dataset``); written last
    tokenizer.json   the tokenizer that produced the ids
    train/, val/     mosaicml-streaming MDS shards, one column ``tokens`` of seq_length+1 ids

Documents are joined with the EOS token into one stream that is cut into samples of
``seq_length + 1`` tokens (inputs plus the next-token label), so no padding is ever trained on.
The validation split is either a seeded random share of those samples (text from the same
files as training) or whole held-out input files (``val_files``: text never trained on, the
tokenizer included); ``index.json``'s ``val_split`` says which.
Inputs are streamed in bounded pieces (``inputs.py``) and encoded in bounded batches, in
order, possibly by several processes (``tokenize.py``), so memory does not grow with the
input. Everything is written into a hidden temporary directory beside ``out_dir`` and renamed
at the end: an interrupted run leaves no directory that looks like a finished dataset.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
from streaming import MDSWriter
from streaming.base.compression import get_compressions, is_compression

from t2train.data.errors import DataError
from t2train.data.index import FORMAT, INDEX_FILE, VERSION
from t2train.data.inputs import PATTERNS, InputFile, check_encoding, encoding_name, resolve_inputs
from t2train.data.progress import progress_meter
from t2train.data.tokenize import Batch, encode_batches
from t2train.data.tokenizer import (
    TOKENIZER_FILE,
    document_bos,
    eos_id,
    load_tokenizer,
    save_tokenizer,
    token_dtype,
    train_tokenizer,
)

__all__ = ["DataError", "prepare_dataset", "resolve_inputs"]

SPLITS = ("train", "val")
DEFAULT_VAL_FRACTION = 0.05
SHARD_HASH = "xxh64"  # recorded per shard file by MDSWriter (fast; streaming ships xxhash)
_BATCH_CHARS = 1 << 22  # text handed to the tokenizer per (parallel) batch


def prepare_dataset(
    inputs: Sequence[str],
    out_dir: str | Path,
    seq_length: int,
    vocab_size: int = 8192,
    tokenizer: Optional[str | Path] = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    compression: Optional[str] = "zstd",
    seed: int = 0,
    text_field: str = "text",
    overwrite: bool = False,
    workers: int = 1,
    progress: bool = False,
    progress_every: float = 0.0,
    encoding: str = "utf-8",
    skip_binary: bool = False,
    patterns: Sequence[str] = PATTERNS,
    val_files: Sequence[str] = (),
    bos: str = "auto",
) -> dict:
    """Tokenize ``inputs`` (files, globs or directories; ``.txt``, ``.jsonl``, ``.parquet``)
    into ``out_dir``.

    A ``.txt`` file is one document; each line of a ``.jsonl`` file and each row of a
    ``.parquet`` file is one, its text in ``text_field``. A directory gives the files under it
    whose names match ``patterns``. Text is decoded from ``encoding``; a file that does not
    look like text in it (``InputFile.not_text``) stops preparation naming the file, or with
    ``skip_binary`` is left out (listed in the index). Without ``tokenizer`` (a
    ``tokenizer.json``), a byte-level BPE of ``vocab_size`` is trained on the inputs first.
    ``workers`` processes encode the text (the output does not depend on it); ``progress``
    shows progress bars on stderr, ``progress_every`` (seconds) instead prints a progress line
    on stdout that often. Without ``val_files`` each sample goes to ``val`` with probability
    ``val_fraction`` (seeded), and both splits get at least one sample. With ``val_files``
    (glob patterns matched against each input's file name, or its whole path) the matching
    inputs are the ``val`` split and the others ``train``, each cut into samples on its own,
    and a trained BPE learns from the ``train`` files only (``val_fraction`` is not used).
    ``bos``: ``auto`` starts each document with the begin token where the tokenizer puts one
    before every text (Llama's ``<s>``), ``always`` with its begin token regardless, ``never``
    not at all; the index records it (``bos_id``). Returns the index written to
    ``out_dir/index.json``.
    """
    _check_settings(seq_length, val_fraction, compression, text_field, workers)
    if tokenizer is None:
        token_dtype(vocab_size)  # refuse a vocabulary too large to store before training it
    paths = resolve_inputs(inputs, patterns)
    check_encoding(encoding, paths)
    files, not_text = _text_files([InputFile(p, text_field, encoding) for p in paths], skip_binary)
    held_out = _held_out(files, val_files)
    meter = functools.partial(progress_meter, bar=progress, every=progress_every)
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, overwrite)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:  # a first pass over the (training) inputs, before anything is written
        learned_from = [file for i, file in enumerate(files) if i not in held_out]
        tok = train_tokenizer(
            (text for _, text, _ in _read(learned_from, "reading for BPE", meter)), vocab_size
        )
    vocab = tok.get_vocab_size()
    dtype = token_dtype(vocab)
    bos_id = document_bos(tok, bos, tokenizer or "the trained tokenizer")

    tmp = out_dir.with_name(f".{out_dir.name}.{uuid.uuid4().hex[:8]}.incomplete")
    tmp.mkdir(parents=True)
    try:
        index = {
            "format": FORMAT,
            "version": VERSION,
            "seq_length": seq_length,
            "vocab_size": vocab,
            "eos_id": eos_id(tok),
            "bos_id": bos_id,
            "token_dtype": dtype,
            "tokenizer": {
                "file": TOKENIZER_FILE,
                "sha256": save_tokenizer(tok, tmp),
                "source": str(tokenizer) if tokenizer else "trained",
                "requested_vocab_size": None if tokenizer else vocab_size,
                "trained_on": None if tokenizer else "training files" if held_out else "all inputs",
            },
            "text_field": text_field,
            "encoding": encoding,
            "val_fraction": None if held_out else val_fraction,
            "val_split": _val_split_facts(files, held_out, val_files, val_fraction, seed),
            "seed": seed,
            "compression": compression,
            "skipped_binary_files": not_text,
        }
        index.update(_write_splits(files, tok, index, tmp, workers, meter, held_out))
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for src in index["sources"]:
        if src["replaced_chars"]:
            warnings.warn(
                f"{src['path']}: {src['replaced_chars']} invalid "
                f"{encoding_name(encoding)} sequence(s) replaced with U+FFFD (text in "
                "another encoding? give it with --encoding)",
                stacklevel=2,
            )
    return index


def _text_files(files: list[InputFile], skip_binary: bool) -> tuple[list[InputFile], list[str]]:
    """The inputs that look like text, and the paths of those that do not (refused unless
    ``skip_binary``)."""
    not_text = [(file, reason) for file in files if (reason := file.not_text())]
    if not_text and not skip_binary:
        file, reason = not_text[0]
        others = f" (and {len(not_text) - 1} more such file(s))" if len(not_text) > 1 else ""
        raise DataError(
            f"input {file.path}: does not look like {encoding_name(file.encoding)} "
            f"text ({reason}){others}; skip such files with --skip-binary, or give "
            "the encoding with --encoding if it is text in another one"
        )
    skipped = {file.path for file, _ in not_text}
    text = [file for file in files if file.path not in skipped]
    if not text:
        raise DataError(f"no text inputs: all {len(files)} input file(s) look binary")
    return text, [str(file.path.resolve()) for file, _ in not_text]


def _held_out(files: list[InputFile], val_files: Sequence[str]) -> set[int]:
    """The indexes of the inputs matching a ``val_files`` pattern; every pattern must match
    one, and at least one input must stay for training."""

    def matches(file: InputFile, pattern: str) -> bool:
        return fnmatch.fnmatchcase(file.path.name, pattern) or fnmatch.fnmatchcase(
            str(file.path), pattern
        )

    held = set()
    for pattern in val_files:
        found = {i for i, file in enumerate(files) if matches(file, pattern)}
        if not found:
            raise DataError(
                f"val_files {pattern!r}: matches none of the {len(files)} input "
                "file(s) (patterns match a file's name or its whole path)"
            )
        held |= found
    if held and len(held) == len(files):
        raise DataError(
            f"val_files {', '.join(map(repr, val_files))}: match all "
            f"{len(files)} input file(s); leave some for training"
        )
    return held


def _val_split_facts(
    files: list[InputFile],
    held_out: set[int],
    val_files: Sequence[str],
    val_fraction: float,
    seed: int,
) -> dict:
    """How the validation split was made, for ``index.json``."""
    if not held_out:
        return {
            "by": "sample",
            "fraction": val_fraction,
            "seed": seed,
            "note": "each sample of the joined token stream goes to val with probability "
            "`fraction`: val text comes from the same files as train",
        }
    return {
        "by": "file",
        "patterns": list(val_files),
        "files": [str(files[i].path.resolve()) for i in sorted(held_out)],
        "note": "whole input files held out: no val text is in train, and a trained "
        "tokenizer learned from the train files only",
    }


def _check_settings(seq_length, val_fraction, compression, text_field, workers) -> None:
    if not isinstance(seq_length, int) or seq_length < 1:
        raise DataError(f"seq_length={seq_length!r}: must be an integer >= 1")
    if not 0 < val_fraction < 1:
        raise DataError(
            f"val_fraction={val_fraction}: must be > 0 and < 1 (training evaluates "
            "on the val split)"
        )
    if compression and not is_compression(compression):
        raise DataError(
            f"compression={compression!r}: expected one of "
            f"{', '.join(sorted(get_compressions()))} or none"
        )
    if not text_field:
        raise DataError(
            "text_field='': must name the JSON field or Parquet column holding each document's text"
        )
    if not isinstance(workers, int) or workers < 1:
        raise DataError(f"workers={workers!r}: must be an integer >= 1")


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse to mix with existing files; replace only a previous dataset, never other data."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise DataError(f"output {out_dir}: exists and is not a directory")
    if not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise DataError(
            f"output directory {out_dir} is not empty; choose another output "
            "directory or pass --overwrite to replace the dataset in it"
        )
    if not (out_dir / INDEX_FILE).is_file():
        raise DataError(
            f"output directory {out_dir} is not empty and holds no prepared "
            f"dataset ({INDEX_FILE}); refusing to delete it, even with --overwrite"
        )


def _write_splits(
    files: list[InputFile], tok, index: dict, out: Path, workers: int, meter, held_out: set[int]
) -> dict:
    """Stream tokens into train/val shards, by sample or by held-out file; returns the index
    fields that describe them."""
    dtype, eos, length = index["token_dtype"], index["eos_id"], index["seq_length"] + 1
    bos = index["bos_id"]
    columns = {"tokens": f"ndarray:{dtype}"}
    rng = np.random.default_rng(index["seed"])
    counts = dict.fromkeys(SPLITS, 0)
    tokens = [0] * len(files)
    # Each shard file's hash goes into streaming's index: the loader checks it before using a
    # shard (data/streams.py, loader.py), so a corrupt file stops the run by name.
    settings = dict(columns=columns, compression=index["compression"], hashes=[SHARD_HASH])
    with (
        MDSWriter(out=str(out / "train"), **settings) as train,
        MDSWriter(out=str(out / "val"), **settings) as val,
    ):
        writers = {"train": train, "val": val}

        def write(sample: np.ndarray, split: str) -> None:
            writers[split].write({"tokens": sample})
            counts[split] += 1

        def stream(members: list[int], what: str) -> Iterator[np.ndarray]:
            """The token ids of ``files[i]`` for ``i`` in ``members``, in order."""
            batches = _batches(_read([files[i] for i in members], what, meter))
            for local_index, ids in encode_batches(tok, eos, dtype, batches, workers, bos):
                tokens[members[local_index]] += len(ids)
                yield ids

        if held_out:
            for split, members in (
                ("train", [i for i in range(len(files)) if i not in held_out]),
                ("val", sorted(held_out)),
            ):
                for sample in _samples(stream(members, f"tokenizing {split} files"), length):
                    write(sample, split)
                if not counts[split]:
                    raise DataError(
                        f"the {split} files give {sum(tokens[i] for i in members)} "
                        f"tokens, fewer than one sample of seq_length+1={length}: "
                        "add text to them or lower the sequence length"
                    )
            total = sum(tokens)
        else:
            total = _write_random_split(
                stream(list(range(len(files))), "tokenizing"),
                length,
                rng,
                index["val_fraction"],
                counts,
                write,
                tokens,
            )
    splits = {
        split: {
            "samples": counts[split],
            "tokens": counts[split] * length,
            "shards": len(json.loads((out / split / "index.json").read_text())["shards"]),
        }
        for split in SPLITS
    }
    stats = [dict(file.stats(), tokens=count) for file, count in zip(files, tokens, strict=True)]
    return {
        "sources": [s for s in stats if s["tokens"]],
        "skipped_empty_files": [s["path"] for s in stats if not s["tokens"]],
        "total_tokens": total,
        "dropped_tokens": total - sum(s["tokens"] for s in splits.values()),
        "splits": splits,
    }


def _write_random_split(
    chunks: Iterator[np.ndarray],
    length: int,
    rng,
    val_fraction: float,
    counts: dict,
    write,
    tokens: list[int],
) -> int:
    """Each sample to ``val`` with probability ``val_fraction``, both splits at least one;
    returns the tokens read."""
    pending = None  # written one sample late, so the last one can fill an empty split
    for sample in _samples(chunks, length):
        if pending is not None:
            write(*pending)
        pending = (sample, "val" if rng.random() < val_fraction else "train")
    total = sum(tokens)
    if pending is None or counts["train"] + counts["val"] == 0:
        raise DataError(
            f"the inputs give {total} tokens, fewer than 2 samples of "
            f"seq_length+1={length}; need one for train and one for val: add "
            "text or lower the sequence length"
        )
    sample, split = pending
    write(sample, "train" if not counts["train"] else "val" if not counts["val"] else split)
    return total


def _read(files: list[InputFile], what: str, meter) -> Iterator[tuple[int, str, bool]]:
    """``(file_index, text, ends_document)`` of every file in order, showing progress with
    ``meter`` (``progress_meter`` but for its first two arguments)."""
    with meter(what, sum(f.size for f in files)) as update:
        done = 0  # the bytes of the files before this one
        for file_index, file in enumerate(files):
            for text, ends in file.pieces():
                yield file_index, text, ends
                update(done + file.bytes_read)
            done += file.size
            update(done)


def _batches(pieces: Iterator[tuple[int, str, bool]]) -> Iterator[tuple[int, Batch]]:
    """About ``_BATCH_CHARS`` of text per batch, each batch from one file (tagged with it);
    a piece starts a document when it is a file's first or follows one that ended one."""
    batch: Batch = []
    size, current, starts = 0, -1, True  # -1: no file yet
    for file_index, text, ends in pieces:
        starts = starts or file_index != current
        if batch and (file_index != current or size >= _BATCH_CHARS):
            yield current, batch
            batch, size = [], 0
        current = file_index
        batch.append((text, starts, ends))
        size += len(text)
        starts = ends
    if batch:
        yield current, batch


def _samples(chunks: Iterator[np.ndarray], length: int) -> Iterator[np.ndarray]:
    """Consecutive, non-overlapping samples of ``length`` tokens; a shorter tail is dropped."""
    rest = None
    for chunk in chunks:
        buf = chunk if rest is None else np.concatenate((rest, chunk))
        full = len(buf) // length * length
        yield from buf[:full].reshape(-1, length)
        rest = buf[full:]


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished dataset to ``out_dir``, replacing a previous one (checked earlier)."""
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.{uuid.uuid4().hex[:8]}.old")
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old)
    else:
        tmp.rename(out_dir)
