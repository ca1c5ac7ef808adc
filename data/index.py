"""A prepared dataset's index (``index.json``): what it holds and how it was tokenized, read
and checked without the libraries that wrote it, so a run or ``t2train config`` answers a
bad ``data.path`` at once."""

from __future__ import annotations

import json
from pathlib import Path

from t2train.data.errors import DataError

FORMAT = "t2train-mds"
VERSION = 1
INDEX_FILE = "index.json"


def read_index(path: str | Path) -> dict:
    """The index of a prepared dataset directory; ``DataError`` if it is not one."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"dataset {path}: no such directory")
    file = path / INDEX_FILE
    if not file.is_file():
        raise DataError(
            f"{path}: not a prepared dataset (no {INDEX_FILE}); run `t2train data prepare`"
        )
    try:
        index = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{file}: malformed ({err})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(f"{file}: malformed (expected a {FORMAT!r} index)")
    if index.get("version") != VERSION:
        raise DataError(
            f"{file}: format version {index.get('version')!r}, expected {VERSION}; "
            "prepare the dataset again"
        )
    for field in ("seq_length", "vocab_size", "eos_id"):
        if not isinstance(index.get(field), int) or index[field] < 0:
            raise DataError(
                f"{file}: malformed ({field}={index.get(field)!r}, expected an integer >= 0)"
            )
    if index.get("token_dtype") not in ("uint16", "uint32") or not isinstance(
        index.get("splits"), dict
    ):
        raise DataError(f"{file}: malformed (token_dtype or splits missing or invalid)")
    return index
