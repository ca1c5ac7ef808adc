"""The user's input files as a stream of documents: plain text, JSONL and Parquet.

Inputs may be larger than memory, so every reader streams its file in bounded pieces (a
plain-text file is cut at blank lines, JSONL is read line by line, Parquet batch by batch)
and never holds a whole file. What a reader repairs or skips is counted on the reader and
reported by preparation, so nothing is dropped or altered silently; what it cannot
interpret (a missing text field, a non-string value) stops preparation with a ``DataError``
naming the file, line or row, and field. Text is decoded as UTF-8 or another ``encoding``;
a file that does not look like text in it (``InputFile.not_text``) is refused or skipped by
preparation before anything is read for training.
"""

from __future__ import annotations

import codecs
import fnmatch
import glob
import json
import threading
from pathlib import Path
from typing import Iterator, Optional, Sequence

from t2train.data.errors import DataError

SUFFIXES = (".txt", ".jsonl", ".parquet")
PATTERNS = tuple(f"*{suffix}" for suffix in SUFFIXES)  # the files taken from a directory
_READ_BYTES = 1 << 20  # longest read from a file at once
_PIECE_CHARS = 1 << 18  # a plain-text piece is cut at the next blank line after this size
_PARQUET_ROWS = 1024  # rows decoded from a Parquet file at once
_SNIFF_BYTES = 1 << 16  # the start of a text file judged by ``not_text``
_NOT_TEXT_SHARE = 0.1  # more invalid sequences per character than this: not text
_REPLACE = "t2train-count-and-replace"  # a codec error handler: U+FFFD, counted per thread
_decode_errors = threading.local()


def _count_and_replace(err: UnicodeError) -> tuple[str, int]:
    if not isinstance(err, UnicodeDecodeError):  # registered for decoding only
        raise err
    _decode_errors.count = getattr(_decode_errors, "count", 0) + 1
    return "\ufffd", err.end


codecs.register_error(_REPLACE, _count_and_replace)


def _counting(decode) -> tuple[str, int]:
    """What ``decode()`` returns, and how many invalid sequences it replaced."""
    before = getattr(_decode_errors, "count", 0)
    text = decode()
    return text, getattr(_decode_errors, "count", 0) - before


def encoding_name(encoding: str) -> str:
    """How messages name an encoding: UTF-8 by its usual name, others as given."""
    return "UTF-8" if codecs.lookup(encoding).name == "utf-8" else encoding


def check_encoding(encoding: str, paths: Sequence[Path]) -> None:
    """Refuse an unknown encoding, or one that JSONL lines cannot be split in."""
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise DataError(
            f"encoding={encoding!r}: unknown (expected a Python codec name, e.g. "
            "utf-8, latin-1, cp1252, utf-16)"
        ) from None
    if "\n".encode(encoding) != b"\n":
        for path in paths:
            if path.suffix == ".jsonl":
                raise DataError(
                    f"input {path}: JSONL needs an encoding that writes a newline "
                    f"as one byte, not {encoding!r} (convert the file to UTF-8)"
                )


def resolve_inputs(inputs: Sequence[str], patterns: Sequence[str] = PATTERNS) -> list[Path]:
    """Expand globs and directories (recursively: the files whose names match one of
    ``patterns``, hidden ones left out), check every path exists and has a known type; in
    order, without repeats."""
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
        for path in (file for match in matches for file in _files_in(match, patterns)):
            if not path.is_file():
                raise DataError(f"input {path}: not a file")
            if path.suffix not in SUFFIXES:
                raise DataError(
                    f"input {path}: unsupported type {path.suffix or '(none)'!r}, "
                    f"expected {', '.join(SUFFIXES[:-1])} or {SUFFIXES[-1]}"
                )
            if path not in paths:
                paths.append(path)
    return paths


def _files_in(path: Path, patterns: Sequence[str]) -> list[Path]:
    """``path`` itself, or the files under a directory whose names match ``patterns``."""
    if not path.is_dir():
        return [path]
    found = sorted(
        file
        for file in path.rglob("*")
        if not any(part.startswith(".") for part in file.relative_to(path).parts)
        and file.is_file()
        and any(fnmatch.fnmatch(file.name, p) for p in patterns)
    )
    if not found:
        raise DataError(
            f"input {path}: a directory without files matching "
            f"{' or '.join(map(repr, patterns))} (in any subdirectory); choose them "
            "with --pattern"
        )
    return found


class InputFile:
    """One input file read as a stream of ``(text, ends_document)`` pieces.

    A ``.txt`` file is one document; each line of a ``.jsonl`` file and each row of a
    ``.parquet`` file is one, its text in the field or column ``text_field``. Text (and a
    binary Parquet column) is decoded from ``encoding``; invalid sequences are replaced with
    U+FFFD (counted in ``replaced``) rather than failing a long run over one bad byte;
    documents of only whitespace are skipped (counted in ``empty_documents``). ``bytes_read``
    follows the reading position, for progress bars.
    """

    def __init__(self, path: Path, text_field: str, encoding: str = "utf-8"):
        self.path, self.text_field, self.encoding = path, text_field, encoding
        self.size = path.stat().st_size
        self.replaced = self.documents = self.empty_documents = self.bytes_read = 0

    def pieces(self) -> Iterator[tuple[str, bool]]:
        self.replaced = self.documents = self.empty_documents = self.bytes_read = 0
        reader = {".txt": self._txt, ".jsonl": self._jsonl, ".parquet": self._parquet}
        yield from reader[self.path.suffix]()

    def stats(self) -> dict:
        """What the last full read found (the index's per-file entry, tokens aside)."""
        return {
            "path": str(self.path.resolve()),
            "bytes": self.size,
            "documents": self.documents,
            "empty_documents": self.empty_documents,
            "replaced_chars": self.replaced,
        }

    def not_text(self) -> Optional[str]:
        """Why the file does not look like text in its encoding (judged by its first 64 KiB:
        NUL characters, or more than one invalid sequence in ten characters), or None.
        Parquet files are binary by design and always pass."""
        if self.path.suffix == ".parquet":
            return None
        with open(self.path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
        decoder = codecs.getincrementaldecoder(self.encoding)(errors=_REPLACE)
        text, invalid = _counting(lambda: decoder.decode(head, len(head) < _SNIFF_BYTES))
        where = "in its first 64 KiB" if len(head) == _SNIFF_BYTES else "in the file"
        if "\0" in text:
            return f"NUL characters {where}"
        if invalid > _NOT_TEXT_SHARE * max(len(text), 1):
            return (
                f"{invalid} invalid {encoding_name(self.encoding)} sequences {where} "
                f"({100 * invalid / max(len(text), 1):.0f}% of the characters)"
            )
        return None

    def _decode(self, raw: bytes, decoder=None, final: bool = False) -> str:
        """``raw`` decoded (by an incremental ``decoder``, or as a whole); counts the
        replacement characters decoding added."""
        text, invalid = _counting(
            lambda: decoder.decode(raw, final) if decoder else raw.decode(self.encoding, _REPLACE)
        )
        self.replaced += invalid
        return text

    def _document(self, text: str) -> Iterator[tuple[str, bool]]:
        if text.strip():
            self.documents += 1
            yield text, True
        else:
            self.empty_documents += 1

    def _txt(self) -> Iterator[tuple[str, bool]]:
        """The whole file is one document, cut into pieces at blank lines (paragraphs)."""
        decoder = codecs.getincrementaldecoder(self.encoding)(errors=_REPLACE)
        lines: list[str] = []
        size, content = 0, False
        with open(self.path, "rb") as f:
            for raw in iter(lambda: f.readline(_READ_BYTES), b""):
                self.bytes_read += len(raw)
                line = self._decode(raw, decoder)
                lines.append(line)
                size += len(line)
                if size >= _PIECE_CHARS and (not line.strip() or size >= 4 * _PIECE_CHARS):
                    piece, lines, size = "".join(lines), [], 0
                    content = content or bool(piece.strip())
                    if content:
                        yield piece, False
        piece = "".join(lines) + self._decode(b"", decoder, final=True)
        if content:  # the document's earlier pieces were yielded: this one ends it
            self.documents += 1
            yield piece, True
        else:  # a file of only whitespace is empty
            yield from self._document(piece)

    def _jsonl(self) -> Iterator[tuple[str, bool]]:
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                self.bytes_read += len(raw)
                line = self._decode(raw)
                if not line.strip():
                    continue
                where = f"{self.path}:{lineno}"
                try:
                    record = json.loads(line)
                except ValueError as err:
                    raise DataError(f"{where}: not valid JSON ({err})") from None
                if not isinstance(record, dict):
                    raise DataError(
                        f"{where}: a JSON {type(record).__name__}, expected an "
                        f"object with a {self.text_field!r} field"
                    )
                if self.text_field not in record:
                    raise DataError(
                        f"{where}: no field {self.text_field!r} (fields: "
                        f"{', '.join(map(repr, record)) or 'none'}); choose the text "
                        "field with --text-field"
                    )
                text = record[self.text_field]
                if not isinstance(text, str):
                    raise DataError(
                        f"{where}: field {self.text_field!r} is "
                        f"{type(text).__name__}, expected a string"
                    )
                yield from self._document(text)

    def _parquet(self) -> Iterator[tuple[str, bool]]:
        """Rows in file order; a ``binary`` column is decoded like the other inputs."""
        pa, pq = _pyarrow(self.path)
        try:
            file = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as err:
            raise DataError(f"{self.path}: not a readable Parquet file ({err})") from None
        schema = file.schema_arrow
        if self.text_field not in schema.names:
            raise DataError(
                f"{self.path}: no column {self.text_field!r} (columns: "
                f"{', '.join(map(repr, schema.names)) or 'none'}); choose the text "
                "column with --text-field"
            )
        kind = schema.field(self.text_field).type
        binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
        if not (binary or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(
                f"{self.path}: column {self.text_field!r} has type {kind}, expected "
                "string (or binary UTF-8)"
            )
        rows, row = max(file.metadata.num_rows, 1), 0
        with file:
            for batch in file.iter_batches(batch_size=_PARQUET_ROWS, columns=[self.text_field]):
                for value in batch.column(0).to_pylist():
                    row += 1
                    if value is None:
                        raise DataError(
                            f"{self.path}: row {row}: column {self.text_field!r} is "
                            "null, expected a string"
                        )
                    text = self._decode(value) if binary else value
                    yield from self._document(text)
                self.bytes_read = self.size * row // rows


def _pyarrow(path: Path):
    """pyarrow and its Parquet module, imported only when a Parquet input is read."""
    try:
        import pyarrow  # noqa: PLC0415 - pyarrow: for Parquet inputs only
        import pyarrow.parquet  # noqa: PLC0415 - pyarrow: for Parquet inputs only
    except ImportError:
        raise DataError(
            f"input {path}: reading Parquet needs pyarrow, which is not installed "
            "(pip install pyarrow)"
        ) from None
    return pyarrow, pyarrow.parquet
