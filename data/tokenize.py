"""Token ids of text batches, in input order, in this process or in worker processes.

Encoding is most of the work of preparing a dataset, so it can fan out over processes. The
results are taken back in submission order, so the dataset is byte-identical for any number
of workers, and one batch per worker is in flight, so memory stays bounded however large the
input is (``Pool.imap`` would read the whole input ahead).

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

# (text, starts_document, ends_document): BOS (if any) goes before a piece that starts one,
# EOS after a piece that ends one
Batch = list[tuple[str, bool, bool]]
Tag = TypeVar("Tag")


def encode_batches(
    tokenizer: Tokenizer,
    eos: int,
    dtype: str,
    batches: Iterable[tuple[Tag, Batch]],
    workers: int = 1,
    bos: Optional[int] = None,
) -> Iterator[tuple[Tag, np.ndarray]]:
    """``(tag, ids)`` for each ``(tag, batch)``, in order; the tag passes through untouched.

    ``workers=1`` encodes in this process (the tokenizers library may still use several
    threads); more starts that many single-threaded worker processes.
    """
    if workers < 1:
        raise ValueError(f"workers={workers}: must be >= 1")
    if workers == 1:
        for tag, batch in batches:
            yield tag, encode(tokenizer, batch, eos, dtype, bos)
        return
    with _Workers(workers, tokenizer.to_str(), eos, dtype, bos) as pool:
        yield from pool.encode_in_order(batches)


class _Workers:
    """Spawned worker processes, each fed through its own pipe by the calling thread alone:
    one batch in flight per worker (so neither side can block sending while the other
    does), results taken in submission order. Without ``multiprocessing.Pool``'s handler
    threads an interrupt or an error ends the workers at once: ``Pool.terminate`` hangs
    when its task thread is blocked sending a batch larger than the pipe's buffer."""

    def __init__(self, count: int, tokenizer_json: str, eos: int, dtype: str, bos: Optional[int]):
        context = multiprocessing.get_context("spawn")
        self.processes: list = []
        self.connections: list = []
        try:
            for _ in range(count):
                ours, theirs = context.Pipe()
                process = context.Process(
                    target=_serve, args=(theirs,), daemon=True, name="t2train-tokenize"
                )
                with _ctrl_c_held():
                    process.start()
                theirs.close()
                self.processes.append(process)
                self.connections.append(ours)
            for connection in self.connections:
                connection.send((tokenizer_json, eos, dtype, bos))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "_Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.close(finished=exc[0] is None)

    def encode_in_order(
        self, batches: Iterable[tuple[Tag, Batch]]
    ) -> Iterator[tuple[Tag, np.ndarray]]:
        idle = deque(range(len(self.connections)))
        pending: deque[tuple[Tag, int]] = deque()  # (tag, worker) in submission order
        for tag, batch in batches:
            if not idle:
                yield self._result(*pending.popleft(), idle)
            worker = idle.popleft()
            self.connections[worker].send(batch)
            pending.append((tag, worker))
        while pending:
            yield self._result(*pending.popleft(), idle)

    def _result(self, tag: Tag, worker: int, idle: deque) -> tuple[Tag, np.ndarray]:
        try:
            ok, value = self.connections[worker].recv()
        except EOFError:
            process = self.processes[worker]
            process.join(timeout=5)
            raise RuntimeError(
                f"tokenizing worker {process.pid} exited with code "
                f"{process.exitcode} before returning its batch"
            ) from None
        if not ok:
            raise value
        idle.append(worker)
        return tag, value

    def close(self, finished: bool = False) -> None:
        """Stop the workers: asked to exit once every batch is done, else terminated."""
        for process, connection in zip(self.processes, self.connections):
            if finished:
                with contextlib.suppress(OSError):
                    connection.send(None)
            process.join(timeout=10 if finished else 0)
            if process.is_alive():
                process.terminate()
                process.join()
            connection.close()


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """While a worker starts: SIGINT ignored, which the spawned worker keeps for its life
    (Ctrl-C reaches the whole process group; this process alone ends, ending the workers,
    with one line rather than a traceback per worker), and blocked in this thread, so that a
    Ctrl-C meanwhile stays pending (Linux does not discard a blocked signal) and reaches this
    process's own handler once it is back. Only another thread of this process that does not
    block SIGINT can still take it, and drop it, within those few milliseconds."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def encode(
    tokenizer: Tokenizer, batch: Batch, eos: int, dtype: str, bos: Optional[int] = None
) -> np.ndarray:
    """The ids of a batch's pieces, concatenated, with EOS after each document's last piece
    and ``bos`` (if not None) before its first."""
    encodings = tokenizer.encode_batch_fast(
        [text for text, _, _ in batch], add_special_tokens=False
    )
    parts = []
    for encoding, (_, starts, ends) in zip(encodings, batch, strict=True):
        if starts and bos is not None:
            parts.append(np.array([bos], dtype=dtype))
        parts.append(np.asarray(encoding.ids, dtype=dtype))
        if ends:
            parts.append(np.array([eos], dtype=dtype))
    return np.concatenate(parts)


def _serve(connection) -> None:
    """A worker: the tokenizer first, then batches until None (or the parent is gone)."""
    tokenizer_json, eos, dtype, bos = connection.recv()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    tokenizer = Tokenizer.from_str(tokenizer_json)
    while True:
        try:
            batch = connection.recv()
        except EOFError:
            return
        if batch is None:
            return
        try:
            result: tuple[bool, object] = (True, encode(tokenizer, batch, eos, dtype, bos))
        except Exception as err:  # raised again in the parent
            result = (False, err)
        connection.send(result)
