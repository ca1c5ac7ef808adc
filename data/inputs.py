"""The user's input files as a stream of documents: plain text, JSONL and Parquet.

Inputs may be larger than memory, so every reader streams its file in bounded pieces (a
plain-text file is cut at blank lines, JSONL is read line by line, Parquet batch by batch)
and never holds a whole file. What a reader repairs or skips is counted on the reader and
reported by preparation, so nothing is dropped or altered silently; what it cannot
interpret (a missing text field, a non-string value) stops preparation with a ``DataError``
naming the file, line or row, and field.
"""

from __future__ import annotations

import codecs
import glob
import json
from pathlib import Path
from typing import Iterator, Sequence

from t2train.data.errors import DataError

SUFFIXES = (".txt", ".jsonl", ".parquet")
_READ_BYTES = 1 << 20  # longest read from a file at once
_PIECE_CHARS = 1 << 18  # a plain-text piece is cut at the next blank line after this size
_PARQUET_ROWS = 1024  # rows decoded from a Parquet file at once
_FFFD = "\ufffd".encode()


def resolve_inputs(inputs: Sequence[str]) -> list[Path]:
    """Expand globs, check every path exists and has a known type; in order, without repeats."""
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
                                f"expected {', '.join(SUFFIXES[:-1])} or {SUFFIXES[-1]}")
            if path not in paths:
                paths.append(path)
    return paths


class InputFile:
    """One input file read as a stream of ``(text, ends_document)`` pieces.

    A ``.txt`` file is one document; each line of a ``.jsonl`` file and each row of a
    ``.parquet`` file is one, its text in the field or column ``text_field``. Invalid UTF-8 is
    decoded with U+FFFD replacements (counted in ``replaced``) rather than failing a long run
    over one bad byte; documents of only whitespace are skipped (counted in
    ``empty_documents``). ``bytes_read`` follows the reading position, for progress bars.
    """

    def __init__(self, path: Path, text_field: str):
        self.path, self.text_field = path, text_field
        self.size = path.stat().st_size
        self.replaced = self.documents = self.empty_documents = self.bytes_read = 0

    def pieces(self) -> Iterator[tuple[str, bool]]:
        self.replaced = self.documents = self.empty_documents = self.bytes_read = 0
        reader = {".txt": self._txt, ".jsonl": self._jsonl, ".parquet": self._parquet}
        yield from reader[self.path.suffix]()

    def stats(self) -> dict:
        """What the last full read found (the index's per-file entry, tokens aside)."""
        return {"path": str(self.path.resolve()), "bytes": self.size,
                "documents": self.documents, "empty_documents": self.empty_documents,
                "replaced_chars": self.replaced}

    def _counted(self, raw: bytes, text: str) -> str:
        """``text`` decoded from ``raw``; counts the replacement characters decoding added."""
        self.replaced += text.count("\ufffd") - raw.count(_FFFD)
        return text

    def _document(self, text: str) -> Iterator[tuple[str, bool]]:
        if text.strip():
            self.documents += 1
            yield text, True
        else:
            self.empty_documents += 1

    def _txt(self) -> Iterator[tuple[str, bool]]:
        """The whole file is one document, cut into pieces at blank lines (paragraphs)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        lines: list[str] = []
        size, content = 0, False
        with open(self.path, "rb") as f:
            for raw in iter(lambda: f.readline(_READ_BYTES), b""):
                self.bytes_read += len(raw)
                line = self._counted(raw, decoder.decode(raw))
                lines.append(line)
                size += len(line)
                if size >= _PIECE_CHARS and (not line.strip() or size >= 4 * _PIECE_CHARS):
                    piece, lines, size = "".join(lines), [], 0
                    content = content or bool(piece.strip())
                    if content:
                        yield piece, False
        piece = "".join(lines) + self._counted(b"", decoder.decode(b"", final=True))
        if content:  # the document's earlier pieces were yielded: this one ends it
            self.documents += 1
            yield piece, True
        else:  # a file of only whitespace is empty
            yield from self._document(piece)

    def _jsonl(self) -> Iterator[tuple[str, bool]]:
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                self.bytes_read += len(raw)
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
                yield from self._document(text)

    def _parquet(self) -> Iterator[tuple[str, bool]]:
        """Rows in file order; a ``binary`` column is decoded as UTF-8 like the other inputs."""
        pa, pq = _pyarrow(self.path)
        try:
            file = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as err:
            raise DataError(f"{self.path}: not a readable Parquet file ({err})") from None
        schema = file.schema_arrow
        if self.text_field not in schema.names:
            raise DataError(f"{self.path}: no column {self.text_field!r} (columns: "
                            f"{', '.join(map(repr, schema.names)) or 'none'}); choose the text "
                            "column with --text-field")
        kind = schema.field(self.text_field).type
        binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
        if not (binary or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(f"{self.path}: column {self.text_field!r} has type {kind}, expected "
                            "string (or binary UTF-8)")
        rows, row = max(file.metadata.num_rows, 1), 0
        with file:
            for batch in file.iter_batches(batch_size=_PARQUET_ROWS, columns=[self.text_field]):
                for value in batch.column(0).to_pylist():
                    row += 1
                    if value is None:
                        raise DataError(f"{self.path}: row {row}: column {self.text_field!r} is "
                                        "null, expected a string")
                    text = self._counted(value, value.decode("utf-8", errors="replace")) \
                        if binary else value
                    yield from self._document(text)
                self.bytes_read = self.size * row // rows


def _pyarrow(path: Path):
    """pyarrow and its Parquet module, imported only when a Parquet input is read."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"input {path}: reading Parquet needs pyarrow, which is not installed "
                        "(pip install pyarrow)") from None
    return pyarrow, pyarrow.parquet
