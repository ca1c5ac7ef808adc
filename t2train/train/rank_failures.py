"""End every rank, with the same error, when one rank fails alone.

Most failures are seen by every rank together: the ranks agree on them in a collective (a
failed save's ``CheckpointException`` from torch DCP, skipped updates, a stop signal). A
failure that one rank sees alone while its peers wait for it in a collective (rank 0 cannot
write a checkpoint's metadata.json while the others wait in the save's barrier) would leave
the peers blocked until the collective timeout (``parallel.collective_timeout_mins``, 10
minutes by default), and then they would report a timeout, not the cause.

Such a failure is raised as ``RankFailure``. The failing rank writes its message into the
process group's key-value store (the TCPStore every rank already talks to), and a thread on
every rank polls that key: each peer prints the same ``error:`` line and exits with the same
code (3) within about a second, whatever collective its main thread is blocked in. The
failing rank exits at once too, without the interpreter's teardown: torchrun stops the other
workers of one that has exited, and a rank still tearing down would be killed by it and
report SIGTERM instead of the error's exit code. For the same reason a rank whose collective
breaks because a peer has already exited (gloo: "Connection closed by peer") ends with the
announced error when the exception leaves the run, before the stop guard unblocks SIGTERM;
without an announcement (the peer was killed) it ends with one line saying that a peer
ended, not a traceback through the collective (``T2_TRACEBACK=1`` prints it too).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Optional

import torch.distributed as dist

from t2train.errors import TrainingHalted
from t2train.train.hard_exit import exit_now

_FAILED = "t2train/rank_failure"
_READ = "t2train/rank_failure_read"
# What a collective raises on this rank when a peer process has gone (gloo, NCCL).
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited or there was a network error",
    "NCCL communicator was aborted",
)


class RankFailures:
    """Context manager around a run: watches for a peer's failure; ``end_all`` for one's own."""

    def __init__(self, poll_seconds: float = 0.5):
        self.poll_seconds = poll_seconds
        self._announced = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, daemon=True, name="t2train-rank-failures"
        )

    def __enter__(self) -> "RankFailures":
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if exc_type is not None and not self._announced:
            message = _announced_by_peer()
            if message is not None:  # a peer's exit broke this rank's collective first
                _exit(message, acknowledge=True)
            if any(gone in str(exc) for gone in PEER_GONE):
                if os.environ.get("T2_TRACEBACK") == "1":
                    traceback.print_exception(exc_type, exc, tb)
                cause = next(line for line in str(exc).splitlines() if line.strip())
                _exit(
                    f"rank {dist.get_rank()}: another rank has ended, breaking a collective "
                    f"({cause[:200]}); its output says why (T2_TRACEBACK=1 prints this "
                    "rank's traceback)"
                )

    def end_all(self, message: str) -> None:
        """This rank failed alone: every rank ends with ``message``, this one included. Returns
        only without peers. Waits (briefly) until the peers have read it: rank 0 may host the
        store."""
        store = _store()
        if store is None:
            return
        self._announced = True
        store.set(_FAILED, message)
        deadline = time.monotonic() + 4 * self.poll_seconds + 2
        while store.add(_READ, 0) < dist.get_world_size() - 1 and time.monotonic() < deadline:
            time.sleep(self.poll_seconds / 5)
        _exit(message)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            if self._announced:
                continue
            try:
                message = _peer_message()
            except Exception:  # the store ended with its host: nothing more to hear
                return
            if message is not None:
                _exit(message, acknowledge=True)  # the main thread is blocked in a collective


def _peer_message() -> Optional[str]:
    store = _store()
    if store is None:
        return None
    return store.get(_FAILED).decode() if store.check([_FAILED]) else None


def _announced_by_peer() -> Optional[str]:
    try:
        return _peer_message()
    except Exception:  # the store ended with its host; the collective timeout remains
        return None


def _exit(message: str, acknowledge: bool = False) -> None:
    """Print the error and exit. A peer (``acknowledge``) tells the failing rank only after
    printing: that rank waits for every peer's word, then exits, and torchrun stops the
    rest."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    if acknowledge:
        try:
            store = _store()
            if store is not None:
                store.add(_READ, 1)
        except Exception:  # the failing rank's wait is bounded
            pass
    exit_now(TrainingHalted.exit_code)


def _store() -> Optional[dist.Store]:
    """The default process group's store (torchrun: the agent's, prefixed per restart), or
    None without peers."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_store()
