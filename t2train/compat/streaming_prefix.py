"""Two scoped patches of mosaicml-streaming's shared-memory prefix choice, without editing it.

A ``StreamingDataset`` picks its six-digit prefix in ``get_shm_prefix``: its local leader
attaches to the segments of every prefix already on the host, takes the first free one and
creates that prefix's ``_locals`` segment. Two things go wrong there, each patched only while a
dataset is made (``data/loader.py``) and nowhere else:

- ``prefix_probes_closed_when_dropped``: each probing attachment registers an ``atexit``
  cleanup that keeps it open until the process exits, a dozen descriptors per dataset per live
  prefix (a process that makes hundreds of datasets ran out: EMFILE).
- ``prefix_registration_serialised``: two leaders starting together find the same free prefix
  and the second create fails (``FileExistsError: '/000000_locals'``).

``PATCHED`` is the contract with streaming. ``tests/test_compat_streaming.py`` checks each
entry still exists with the arguments used here, and the data tests reproduce both faults
with the patch removed, so an upgrade that renames or fixes them fails loudly.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from streaming.base import dataset as streaming_dataset
from streaming.base.shared import prefix

# (module, attribute) of streaming replaced while a dataset is made.
PATCHED = (
    ("streaming.base.shared.prefix", "SharedMemory"),
    ("streaming.base.dataset", "get_shm_prefix"),
)
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


def prefix_registration_serialised():
    """While a ``StreamingDataset`` is made: its local leader picks and registers its prefix
    holding a host-wide file lock, so a second leader looks only after the first registered.

    The leader holds the lock through streaming's barriers, so only the leaders of
    single-node jobs take it: their barriers wait for ranks on this host that never lock.
    A multi-node job's leader would wait in them for leaders on other hosts, which may be
    queued behind another multi-node job's leader there: a deadlock across hosts. Those
    keep streaming's race.
    """
    original = streaming_dataset.get_shm_prefix

    def serialised(streams_local, streams_remote, world, *args, **kwargs):
        if not world.is_local_leader or world.is_multinode:
            return original(streams_local, streams_remote, world, *args, **kwargs)
        # Read-only is enough for flock, so another user's lock file serves too.
        fd = os.open(PREFIX_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return original(streams_local, streams_remote, world, *args, **kwargs)
        finally:
            os.close(fd)  # releases the lock

    return _replaced(streaming_dataset, "get_shm_prefix", serialised)
