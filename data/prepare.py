"""Turn text files into a prepared dataset: MDS shards of fixed-length token samples.

Layout of ``out_dir`` (what ``t2train train data.path=...`` reads)::

    index.json       what was built from what (see ``prepare_dataset``); written last
    tokenizer.json   the tokenizer that produced the ids
    train/, val/     mosaicml-streaming MDS shards, one column ``tokens`` of seq_length+1 ids

Documents are joined with the EOS token into one stream that is cut into samples of
``seq_length + 1`` tokens (inputs plus the next-token label), so no padding is ever trained on.
Inputs are streamed in bounded pieces, never read whole. Everything is written into a hidden
temporary directory beside ``out_dir`` and renamed at the end: an interrupted run leaves no
directory that looks like a finished dataset.
"""

from __future__ import annotations

import codecs
import glob
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
from t2train.data.tokenizer import (TOKENIZER_FILE, eos_id, load_tokenizer, save_tokenizer,
                                    train_tokenizer)

__all__ = ["DataError", "prepare_dataset", "read_index", "resolve_inputs"]

FORMAT = "t2train-mds"
VERSION = 1
INDEX_FILE = "index.json"
SPLITS = ("train", "val")
SUFFIXES = (".txt", ".jsonl")
_READ_BYTES = 1 << 20  # longest read from a file at once
_PIECE_CHARS = 1 << 18  # a plain-text piece is cut at the next blank line after this size
_BATCH_CHARS = 1 << 22  # text handed to the tokenizer per (parallel) batch
_FFFD = "\ufffd".encode()


def prepare_dataset(inputs: Sequence[str], out_dir: str | Path, seq_length: int,
                    vocab_size: int = 8192, tokenizer: Optional[str | Path] = None,
                    val_fraction: float = 0.05, compression: Optional[str] = "zstd",
                    seed: int = 0, text_field: str = "text", overwrite: bool = False) -> dict:
    """Tokenize ``inputs`` (files or globs; ``.txt`` or ``.jsonl``) into ``out_dir``.

    A ``.txt`` file is one document; each line of a ``.jsonl`` file is one, its text in
    ``text_field``. Without ``tokenizer`` (a ``tokenizer.json``), a byte-level BPE of
    ``vocab_size`` is trained on the inputs first. Each sample goes to ``val`` with probability
    ``val_fraction`` (seeded), and both splits get at least one sample. Returns the index
    written to ``out_dir/index.json``.
    """
    _check_settings(seq_length, val_fraction, compression, text_field)
    sources = [_Source(path, text_field) for path in resolve_inputs(inputs)]
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, overwrite)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:  # a first pass over the inputs, before anything is written
        tok = train_tokenizer((text for src in sources for text, _ in src.pieces()), vocab_size)
    vocab = tok.get_vocab_size()
    dtype = _token_dtype(vocab)

    tmp = out_dir.with_name(f".{out_dir.name}.{uuid.uuid4().hex[:8]}.incomplete")
    tmp.mkdir(parents=True)
    try:
        index = {"format": FORMAT, "version": VERSION, "seq_length": seq_length,
                 "vocab_size": vocab, "eos_id": eos_id(tok), "token_dtype": dtype,
                 "tokenizer": {"file": TOKENIZER_FILE, "sha256": save_tokenizer(tok, tmp),
                               "source": str(tokenizer) if tokenizer else "trained",
                               "requested_vocab_size": None if tokenizer else vocab_size},
                 "text_field": text_field, "val_fraction": val_fraction, "seed": seed,
                 "compression": compression}
        index.update(_write_splits(sources, tok, index, tmp))
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for src in index["sources"]:
        if src["replaced_chars"]:
            warnings.warn(f"{src['path']}: {src['replaced_chars']} invalid UTF-8 sequence(s) "
                          "replaced with U+FFFD", stacklevel=2)
    return index


def read_index(path: str | Path) -> dict:
    """The index of a prepared dataset directory; ``DataError`` if it is not one."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"dataset {path}: no such directory")
    file = path / INDEX_FILE
    if not file.is_file():
        raise DataError(f"{path}: not a prepared dataset (no {INDEX_FILE}); "
                        "run `t2train data prepare`")
    try:
        index = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{file}: malformed ({err})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(f"{file}: malformed (expected a {FORMAT!r} index)")
    if index.get("version") != VERSION:
        raise DataError(f"{file}: format version {index.get('version')!r}, expected {VERSION}; "
                        "prepare the dataset again")
    for field in ("seq_length", "vocab_size", "eos_id"):
        if not isinstance(index.get(field), int) or index[field] < 0:
            raise DataError(f"{file}: malformed ({field}={index.get(field)!r}, expected an "
                            "integer >= 0)")
    if index.get("token_dtype") not in ("uint16", "uint32") or not isinstance(
            index.get("splits"), dict):
        raise DataError(f"{file}: malformed (token_dtype or splits missing or invalid)")
    return index


def resolve_inputs(inputs: Sequence[str]) -> list[Path]:
    """Expand globs, check every path exists and is .txt/.jsonl; in order, without repeats."""
    if not inputs:
        raise DataError("no inputs: give input files or globs (or a corpus name)")
    paths: list[Path] = []
    for item in map(str, inputs):
        if glob.has_magic(item):
            matches = sorted(Path(p) for p in glob.glob(item, recursive=True))
            if not matches:
                raise DataError(f"input {item!r}: the glob matches no files")
        else:
            matches = [Path(item)]
            if not matches[0].exists():
                raise DataError(f"input {item}: no such file")
        for path in matches:
            if not path.is_file():
                raise DataError(f"input {path}: not a file")
            if path.suffix not in SUFFIXES:
                raise DataError(f"input {path}: unsupported type {path.suffix or '(none)'!r}, "
                                f"expected {' or '.join(SUFFIXES)}")
            if path not in paths:
                paths.append(path)
    return paths


class _Source:
    """One input file read as a stream of ``(text, ends_document)`` pieces.

    Invalid UTF-8 is decoded with U+FFFD replacements (counted in ``replaced``) rather than
    failing a long run over one bad byte.
    """

    def __init__(self, path: Path, text_field: str):
        self.path, self.text_field = path, text_field
        self.replaced = 0
        self.documents = 0

    def pieces(self) -> Iterator[tuple[str, bool]]:
        self.replaced = self.documents = 0
        yield from self._jsonl() if self.path.suffix == ".jsonl" else self._txt()

    def _counted(self, raw: bytes, text: str) -> str:
        """``text`` decoded from ``raw``; counts the replacement characters decoding added."""
        self.replaced += text.count("\ufffd") - raw.count(_FFFD)
        return text

    def _txt(self) -> Iterator[tuple[str, bool]]:
        """The whole file is one document, cut into pieces at blank lines (paragraphs)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        lines: list[str] = []
        size, content = 0, False
        with open(self.path, "rb") as f:
            for raw in iter(lambda: f.readline(_READ_BYTES), b""):
                line = self._counted(raw, decoder.decode(raw))
                lines.append(line)
                size += len(line)
                if size >= _PIECE_CHARS and (not line.strip() or size >= 4 * _PIECE_CHARS):
                    piece, lines, size = "".join(lines), [], 0
                    content = content or bool(piece.strip())
                    if content:
                        yield piece, False
        piece = "".join(lines) + self._counted(b"", decoder.decode(b"", final=True))
        if content or piece.strip():  # a file of only whitespace is empty
            self.documents = 1
            yield piece, True

    def _jsonl(self) -> Iterator[tuple[str, bool]]:
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = self._counted(raw, raw.decode("utf-8", errors="replace"))
                if not line.strip():
                    continue
                where = f"{self.path}:{lineno}"
                try:
                    record = json.loads(line)
                except ValueError as err:
                    raise DataError(f"{where}: not valid JSON ({err})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{where}: a JSON {type(record).__name__}, expected an "
                                    f"object with a {self.text_field!r} field")
                if self.text_field not in record:
                    raise DataError(f"{where}: no field {self.text_field!r} (fields: "
                                    f"{', '.join(map(repr, record)) or 'none'}); choose the text "
                                    "field with --text-field")
                text = record[self.text_field]
                if not isinstance(text, str):
                    raise DataError(f"{where}: field {self.text_field!r} is "
                                    f"{type(text).__name__}, expected a string")
                if text.strip():
                    self.documents += 1
                    yield text, True


def _check_settings(seq_length, val_fraction, compression, text_field) -> None:
    if not isinstance(seq_length, int) or seq_length < 1:
        raise DataError(f"seq_length={seq_length!r}: must be an integer >= 1")
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction}: must be > 0 and < 1 (training evaluates "
                        "on the val split)")
    if compression and not is_compression(compression):
        raise DataError(f"compression={compression!r}: expected one of "
                        f"{', '.join(sorted(get_compressions()))} or none")
    if not text_field:
        raise DataError("text_field='': must name the JSON field holding each document's text")


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse to mix with existing files; replace only a previous dataset, never other data."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise DataError(f"output {out_dir}: exists and is not a directory")
    if not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise DataError(f"output directory {out_dir} is not empty; choose another output "
                        "directory or pass --overwrite to replace the dataset in it")
    if not (out_dir / INDEX_FILE).is_file():
        raise DataError(f"output directory {out_dir} is not empty and holds no prepared "
                        f"dataset ({INDEX_FILE}); refusing to delete it, even with --overwrite")


def _token_dtype(vocab_size: int) -> str:
    if vocab_size <= np.iinfo(np.uint16).max:
        return "uint16"
    if vocab_size <= np.iinfo(np.uint32).max:
        return "uint32"
    raise DataError(f"tokenizer vocabulary of {vocab_size} tokens: too large, at most "
                    f"{np.iinfo(np.uint32).max} fit the uint32 token column")


def _write_splits(sources: list[_Source], tok, index: dict, out: Path) -> dict:
    """Stream tokens into train/val shards; returns the index fields that describe them."""
    dtype, eos, length = index["token_dtype"], index["eos_id"], index["seq_length"] + 1
    columns = {"tokens": f"ndarray:{dtype}"}
    rng = np.random.default_rng(index["seed"])
    counts = dict.fromkeys(SPLITS, 0)
    stats: list[dict] = []
    with MDSWriter(out=str(out / "train"), columns=columns, compression=index["compression"]) \
            as train, MDSWriter(out=str(out / "val"), columns=columns,
                                compression=index["compression"]) as val:
        writers = {"train": train, "val": val}

        def write(sample: np.ndarray, split: str) -> None:
            writers[split].write({"tokens": sample})
            counts[split] += 1

        pending = None  # written one sample late, so the last one can fill an empty split
        for sample in _samples(_token_stream(sources, tok, eos, dtype, stats), length):
            if pending is not None:
                write(*pending)
            pending = (sample, "val" if rng.random() < index["val_fraction"] else "train")
        total = sum(s["tokens"] for s in stats)
        if pending is None or counts["train"] + counts["val"] == 0:
            raise DataError(f"the inputs give {total} tokens, fewer than 2 samples of "
                            f"seq_length+1={length}; need one for train and one for val: add "
                            "text or lower the sequence length")
        sample, split = pending
        write(sample, "train" if not counts["train"] else "val" if not counts["val"] else split)
    splits = {split: {"samples": counts[split], "tokens": counts[split] * length,
                      "shards": len(json.loads((out / split / "index.json").read_text())
                                    ["shards"])}
              for split in SPLITS}
    return {"sources": [s for s in stats if s["tokens"]],
            "skipped_empty_files": [s["path"] for s in stats if not s["tokens"]],
            "total_tokens": total,
            "dropped_tokens": total - sum(s["tokens"] for s in splits.values()),
            "splits": splits}


def _token_stream(sources: list[_Source], tok, eos: int, dtype: str,
                  stats: list[dict]) -> Iterator[np.ndarray]:
    """Token ids of all documents, each followed by EOS; appends one stats entry per file."""
    for src in sources:
        tokens = 0
        batch: list[tuple[str, bool]] = []
        size = 0
        for text, ends in src.pieces():
            batch.append((text, ends))
            size += len(text)
            if size >= _BATCH_CHARS:
                ids = _encode(tok, batch, eos, dtype)
                tokens += len(ids)
                yield ids
                batch, size = [], 0
        if batch:
            ids = _encode(tok, batch, eos, dtype)
            tokens += len(ids)
            yield ids
        stats.append({"path": str(src.path.resolve()), "bytes": src.path.stat().st_size,
                      "documents": src.documents, "tokens": tokens,
                      "replaced_chars": src.replaced})


def _encode(tok, batch: list[tuple[str, bool]], eos: int, dtype: str) -> np.ndarray:
    encodings = tok.encode_batch_fast([text for text, _ in batch], add_special_tokens=False)
    parts = []
    for encoding, (_, ends) in zip(encodings, batch, strict=True):
        parts.append(np.asarray(encoding.ids, dtype=dtype))
        if ends:
            parts.append(np.array([eos], dtype=dtype))
    return np.concatenate(parts)


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
