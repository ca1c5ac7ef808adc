"""Two scoped patches of mosaicml-streaming's shared-memory prefix choice, without editing it.

A ``StreamingDataset`` picks its six-digit prefix in ``get_shm_prefix``: its local leader
attaches to the segments of every prefix already on the host, takes the first free one and
creates that prefix's ``_locals`` segment. Three things go wrong there, each patched only while
a dataset is made (``data/loader.py``) and nowhere else:

- ``prefix_probes_closed_when_dropped``: each probing attachment registers an ``atexit``
  cleanup that keeps it open until the process exits, a dozen descriptors per dataset per live
  prefix (a process that makes hundreds of datasets ran out: EMFILE).
- ``prefix_chosen_by_the_leader``: two leaders starting together find the same free prefix
  and the second create fails (``FileExistsError: '/000000_locals'``); and every other rank
  of the host searches for itself, so it takes another prefix than its leader registered when
  the host's segments change between the two searches. They do on a busy host, and in a
  restart: the killed attempt's segments are being removed, other jobs' datasets come and go,
  and the leader waits for the lock below while the others search at once. The rank then
  found another job's ``_locals``, or none: "Internal error: shared memory registered does
  not match local leader" (or "was not registered by local leader").

``PATCHED`` and ``PRIVATE`` are the contract with streaming. ``tests/test_compat_streaming.py``
checks each entry still exists with the arguments used here, and the data and launcher tests
reproduce the faults with the patches removed, so an upgrade that renames or fixes them fails
loudly.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch.distributed as dist
from streaming.base import dataset as streaming_dataset
from streaming.base.constant import LOCALS, SHM_TO_CLEAN
from streaming.base.shared import prefix

# (module, attribute) of streaming replaced while a dataset is made.
PATCHED = (
    ("streaming.base.shared.prefix", "SharedMemory"),
    ("streaming.base.dataset", "get_shm_prefix"),
)
# streaming's helpers of ``get_shm_prefix`` that ``prefix_chosen_by_the_leader`` calls, with
# their leading arguments.
PRIVATE = {
    "_check_self": ["streams_local"],
    "_check_and_find_retrying": ["streams_local", "streams_remote", "shm_name", "retry"],
    "_pack_locals": ["dirnames", "prefix_int"],
    "_unpack_locals": ["data"],
    "_get_path": ["prefix_int", "name"],
}
# Beside the segments it guards: every process that sees them sees it (TMPDIR may be per job).
PREFIX_LOCK = Path("/dev/shm") / "t2train-streaming-prefix.lock"


@contextmanager
def _replaced(module: Any, name: str, replacement: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def prefix_probes_closed_when_dropped():
    """While a ``StreamingDataset`` is made: its attachments to existing segments register no
    ``atexit`` cleanup, so a dropped one is closed at once.

    The segments a dataset creates keep their handler; those it keeps are released by
    ``t2train.data.shm.release_shared_memory``.
    """
    original = prefix.SharedMemory

    def attach_without_handler(name=None, create=None, size=0, auto_cleanup=True):
        return original(name, create, size, auto_cleanup=auto_cleanup and create is not False)

    return _replaced(prefix, "SharedMemory", attach_without_handler)


def prefix_chosen_by_the_leader(group: Optional[Any] = None):
    """While a ``StreamingDataset`` is made: only each host's leader searches for a free
    prefix, holding a host-wide file lock until it has registered it (so a second leader looks
    only after the first registered), and the other ranks take the prefix their leader
    registered (an all-gather over ``group``, the dataset's readers; None: the default group)
    instead of searching for themselves.

    streaming searches on every rank, and holds no lock: two leaders could take the same
    prefix, and a rank whose search saw the host's segments at another moment than its
    leader's took another prefix. Here nothing collective runs under the lock, so leaders of
    multi-node jobs lock too (streaming's barriers under it could wait for a leader on another
    host queued behind another job's there).
    """

    def chosen(streams_local, streams_remote, world, retry: int = 100):
        prefix._check_self(streams_local)
        number, segment = None, None
        if world.is_local_leader:
            with _host_prefix_lock():
                number = max(
                    prefix._check_and_find_retrying(streams_local, streams_remote, name, retry)
                    for name in SHM_TO_CLEAN
                )
                data = prefix._pack_locals(streams_local, number)
                segment = prefix.SharedMemory(prefix._get_path(number, LOCALS), True, len(data))
                segment.buf[: len(data)] = data
        if dist.is_initialized():
            registered: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(registered, (world.node, number), group=group)
            if not world.is_local_leader:
                number = next(n for node, n in registered if node == world.node and n is not None)
                segment = _leaders_registration(streams_local, number)
        return number, segment

    return _replaced(streaming_dataset, "get_shm_prefix", chosen)


@contextmanager
def _host_prefix_lock() -> Iterator[None]:
    """The host-wide lock of prefix registration, ``PREFIX_LOCK``."""
    # Read-only is enough for flock, so another user's lock file serves too.
    fd = os.open(PREFIX_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _leaders_registration(streams_local: list[str], number: int):
    """Attach to the ``_locals`` segment this rank's leader registered as prefix ``number``."""
    segment = prefix.SharedMemory(prefix._get_path(number, LOCALS), False)
    locals_, registered = prefix._unpack_locals(bytes(segment.buf))
    if (locals_, registered) != (streams_local, number):
        raise RuntimeError(
            f"shared-memory prefix {number}: its _locals segment names {locals_} (prefix "
            f"{registered}), not this dataset's {streams_local}, which this rank's leader "
            "registered there: another process replaced it meanwhile"
        )
    return segment
