"""Remove what killed mosaicml-streaming runs left on this host: shared memory and lock files.

streaming gives each dataset a six-digit prefix and names its shared-memory segments
``/dev/shm/<prefix>_<name>`` and its lock files ``<tmpdir>/<prefix>_<name>_filelock``. A run
killed by SIGKILL or a crash never unlinks them, and they break later runs: a new dataset
skips every prefix that still has lock files (so prefixes only grow), and one whose leftover
``<prefix>_locals`` segment names the same local directory with a remote fails with
"Reused local directory".

streaming's own ``clean_stale_shared_memory`` is not enough: it unlinks prefixes from 0 up to
the first one without leftovers (missing later ones, which is where the prefixes of runs that
skipped lock files are), unlinks the segments of live datasets too (other jobs on the host),
and never removes lock files. Here a prefix is stale when no process on the host maps any of
its segments, as read from ``/proc/<pid>/maps``: a live dataset keeps its segments mapped from
construction to destruction. Only mappings on this ``/dev/shm``'s device count: a process in
another mount namespace (a container, a job with a private ``/dev/shm``) maps its own
``/dev/shm/000000_...``, which protects nothing here. Files of other users are left alone
(they cannot be unlinked). A file changed since shortly before the scan began is left too: it
may be a dataset's that registered its prefix while the scan ran (made after the scan read
its process's maps), and unlinking it would free that live dataset's prefix for another.
"""

from __future__ import annotations

import atexit
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK, LOCALS, SHM_TO_CLEAN
from streaming.base.shared.memory import SharedMemory

SHM_DIR = Path("/dev/shm")
_SEGMENT = re.compile(r"(\d{6})_(?:%s)" % "|".join(sorted({*SHM_TO_CLEAN, LOCALS})))
_LOCK = re.compile(rf"(\d{{6}})_(?:{BARRIER_FILELOCK}|{CACHE_FILELOCK})")
# Files changed less than this before a scan began are not judged by it: a segment is mapped
# right after it is made, and file times come from a clock a few ticks coarse.
SETTLING_S = 0.5


def clean_stale_streaming_files(lock_dir: Optional[str | Path] = None) -> list[Path]:
    """Unlink the segments and lock files of streaming prefixes no live process uses.

    ``lock_dir`` is where streaming puts lock files (default: ``tempfile.gettempdir()``, as
    streaming does). Returns what was removed.
    """
    lock_dir = Path(lock_dir or tempfile.gettempdir())
    settled = time.time() - SETTLING_S
    live = _mapped_prefixes()
    removed = []
    for folder, pattern in ((SHM_DIR, _SEGMENT), (lock_dir, _LOCK)):
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            match = pattern.fullmatch(path.name)
            if match and match.group(1) not in live and changed_before(path, settled):
                try:
                    path.unlink()
                except FileNotFoundError:  # removed meanwhile by another cleaner
                    continue
                except PermissionError:  # another user's, which this user cannot remove
                    continue
                removed.append(path)
    return removed


def changed_before(path: Path, moment: float) -> bool:
    """Whether ``path`` was last changed before ``moment`` (False once it is gone)."""
    try:
        return path.stat().st_mtime < moment
    except FileNotFoundError:  # removed meanwhile
        return False


def _mapped_prefixes() -> set[str]:
    """The prefixes of the streaming segments that some process on this host maps now, from
    this ``/dev/shm`` (the maps' device field, ``major:minor`` in hex).

    A mapping of an unlinked segment (``... (deleted)`` in the maps) protects no file: the
    prefix's files now on disk are a later dataset's, live only if mapped themselves.
    """
    if not SHM_DIR.is_dir():
        return set()
    device = os.stat(SHM_DIR).st_dev
    ours = (os.major(device), os.minor(device))
    prefixes: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is another user's
            continue
        prefixes |= prefixes_mapped(text, ours)
    return prefixes


_MAPPED = re.compile(
    rf"^\S+ \S+ \S+ ([0-9a-f]+):([0-9a-f]+) \d+ +{re.escape(str(SHM_DIR))}/{_SEGMENT.pattern}$",
    re.MULTILINE,
)


def prefixes_mapped(maps: str, device: tuple[int, int]) -> set[str]:
    """The prefixes of the segments one process's ``maps`` holds on ``device`` (major, minor)."""
    return {
        match.group(3)
        for match in _MAPPED.finditer(maps)
        if (int(match.group(1), 16), int(match.group(2), 16)) == device
    }


def release_shared_memory(dataset) -> None:
    """Close (and, where this process created them, unlink) a finished ``StreamingDataset``'s
    shared-memory segments now.

    streaming registers an ``atexit`` cleanup per segment, and that handler keeps the
    segment and its file descriptor alive until the process exits, dataset or not: a process
    that trains many times (``t2train experiment compare``, the test suite) gains a dozen or
    more descriptors and segments per dataset, and ran out of descriptors (EMFILE) after
    some hundred datasets. The dataset's background threads must have ended (its iterator's
    ``exit()``), as they read the segments.
    """
    for segment in list(_segments_of(dataset)):
        segment.cleanup()
        atexit.unregister(segment.cleanup)


def _segments_of(obj, depth: int = 0) -> Iterator[SharedMemory]:
    """The ``SharedMemory`` objects ``obj`` holds directly or through streaming's shared
    arrays, scalars and barriers (which wrap them)."""
    for value in vars(obj).values():
        if isinstance(value, SharedMemory):
            yield value
        elif depth < 2 and type(value).__module__.startswith("streaming.base.shared"):
            yield from _segments_of(value, depth + 1)
