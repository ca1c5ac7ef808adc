"""The tokenizer a run was trained with: ``tokenizer.json`` of its dataset (``data.path``), or
of the import's folder for a checkpoint ``t2train import hf`` wrote.

Checkpoints record the tokenizer's sha256 (``tokenizer_sha256``); a tokenizer file given in
its place (``--tokenizer``, when the dataset has moved) must have that hash.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from t2train.data.errors import DataError
from t2train.data.tokenizer import (
    EOS,
    TOKENIZER_FILE,
    eos_id,
    eos_token,
    file_sha256,
    load_tokenizer,
)
from t2train.export.load import Checkpoint

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass
class RunTokenizer:
    path: Path
    sha256: str
    tokenizer: Tokenizer
    eos_id: int
    eos_token: str = EOS
    bos_id: Optional[int] = None  # the token each training document started with

    def encode_prompt(self, text: str) -> list[int]:
        """``text``'s ids as a document of the run's training data began."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids if self.bos_id is None else [self.bos_id, *ids]


def run_tokenizer_hash(checkpoint: Checkpoint) -> Optional[str]:
    """The sha256 the checkpoint records, else that of its dataset's index (older checkpoints),
    else None."""
    recorded = checkpoint.train_state.get("tokenizer_sha256")
    if recorded:
        return recorded
    from t2train.data.index import read_index

    try:
        return read_index(checkpoint.config.data.path)["tokenizer"]["sha256"]
    except (DataError, KeyError, TypeError):
        return None


def _is_import(checkpoint: Checkpoint) -> bool:
    """A checkpoint ``t2train import hf`` wrote: no dataset (its data.path is empty); its
    tokenizer sits in the import's folder, ``OUT/checkpoints/step_*/../../tokenizer.json``
    (found from the checkpoint, so from any directory and after the folder moves)."""
    return not checkpoint.config.data.path and "imported_from" in checkpoint.train_state


def run_tokenizer(checkpoint: Checkpoint, given: Optional[str | Path] = None) -> RunTokenizer:
    """The run's tokenizer, or ``given`` if its hash is the run's; a one-line error if the file
    is missing, unreadable or of another vocabulary."""
    expected = run_tokenizer_hash(checkpoint)
    if given is not None:
        path = Path(given)
        path = path / TOKENIZER_FILE if path.is_dir() else path
    elif _is_import(checkpoint):
        path = checkpoint.path.parent.parent / TOKENIZER_FILE
        if not path.is_file():
            raise DataError(
                f"tokenizer {path}: not found; an imported model keeps its tokenizer in "
                "the import's folder (t2train import hf OUT writes OUT/tokenizer.json): "
                "pass --tokenizer FILE if it has moved"
            )
    else:
        path = Path(checkpoint.config.data.path) / TOKENIZER_FILE
        if not path.is_file():
            raise DataError(
                f"tokenizer {path}: not found; the run's dataset (data.path="
                f"{checkpoint.config.data.path!r}) holds the tokenizer it was trained "
                "with: pass --tokenizer FILE if the dataset has moved"
            )
    tokenizer = load_tokenizer(path)
    sha = file_sha256(path)
    if expected is not None and sha != expected:
        raise DataError(
            f"tokenizer {path}: sha256 {sha[:12]}, but the run was trained with "
            f"tokenizer {expected[:12]}"
        )
    return RunTokenizer(
        path,
        sha,
        tokenizer,
        eos_id(tokenizer, path),
        eos_token(tokenizer, path),
        checkpoint.train_state.get("bos_id"),
    )
