"""Token ids of text batches, in input order, in this process or in worker processes.

Encoding is most of the work of preparing a dataset, so it can fan out over processes. The
results are taken back in submission order, so the dataset is byte-identical for any number
of workers, and at most ``2 * workers`` batches are in flight, so memory stays bounded
however large the input is (``Pool.imap`` would read the whole input ahead).

Workers are spawned, not forked: the parent has usually run the tokenizers library's own
thread pool already (training the BPE), which a forked child cannot use safely. Each worker
encodes on one thread, so ``workers`` processes use ``workers`` cores.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections import deque
from typing import Iterable, Iterator, Optional, TypeVar

import numpy as np
from tokenizers import Tokenizer

Batch = list[tuple[str, bool]]  # (text, ends_document): EOS follows a piece that ends one
Tag = TypeVar("Tag")

_worker: Optional[tuple[Tokenizer, int, str]] = None  # a worker's (tokenizer, eos, dtype)


def encode_batches(tokenizer: Tokenizer, eos: int, dtype: str,
                   batches: Iterable[tuple[Tag, Batch]],
                   workers: int = 1) -> Iterator[tuple[Tag, np.ndarray]]:
    """``(tag, ids)`` for each ``(tag, batch)``, in order; the tag passes through untouched.

    ``workers=1`` encodes in this process (the tokenizers library may still use several
    threads); more starts that many single-threaded worker processes.
    """
    if workers < 1:
        raise ValueError(f"workers={workers}: must be >= 1")
    if workers == 1:
        for tag, batch in batches:
            yield tag, encode(tokenizer, batch, eos, dtype)
        return
    context = multiprocessing.get_context("spawn")
    with _ignoring_ctrl_c():  # inherited: Ctrl-C interrupts this process alone, which ends them
        pool = context.Pool(workers, initializer=_start_worker,
                            initargs=(tokenizer.to_str(), eos, dtype))
    with pool:
        pending: deque = deque()
        for tag, batch in batches:
            pending.append((tag, pool.apply_async(_encode_in_worker, (batch,))))
            if len(pending) >= 2 * workers:
                tag, result = pending.popleft()
                yield tag, result.get()
        while pending:
            tag, result = pending.popleft()
            yield tag, result.get()


@contextlib.contextmanager
def _ignoring_ctrl_c() -> Iterator[None]:
    """SIGINT ignored while worker processes start (they keep it ignored: a spawned Python
    leaves an inherited SIG_IGN in place), so Ctrl-C does not print a traceback per worker."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, saved)


def encode(tokenizer: Tokenizer, batch: Batch, eos: int, dtype: str) -> np.ndarray:
    """The ids of a batch's pieces, concatenated, with EOS after each document's last piece."""
    encodings = tokenizer.encode_batch_fast([text for text, _ in batch], add_special_tokens=False)
    parts = []
    for encoding, (_, ends) in zip(encodings, batch, strict=True):
        parts.append(np.asarray(encoding.ids, dtype=dtype))
        if ends:
            parts.append(np.array([eos], dtype=dtype))
    return np.concatenate(parts)


def _start_worker(tokenizer_json: str, eos: int, dtype: str) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _worker = (Tokenizer.from_str(tokenizer_json), eos, dtype)


def _encode_in_worker(batch: Batch) -> np.ndarray:
    tokenizer, eos, dtype = _worker
    return encode(tokenizer, batch, eos, dtype)
