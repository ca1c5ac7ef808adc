"""One writer per run directory: a lock rank 0 holds on ``<run_dir>/t2train.lock`` for the
whole run.

Two runs on one run directory (a job resubmitted while the first still runs, a command with
the same ``name``) corrupt each other: the second drops what the first logged since its
checkpoint, and both publish checkpoints and move ``latest`` back and forth. So before a run
writes anything, rank 0 takes the lock, and a second run is refused in one line naming the
holder. The lock is

* an OS lock (``fcntl.flock``) on the file, released by the kernel when the process ends,
  so a killed run leaves no stale lock behind;
* the holder (host, pid, SLURM job, start) written into the file, and a heartbeat: the
  file's modification time, touched every ``HEARTBEAT`` seconds by a thread. Some shared
  filesystems do not carry ``flock`` from node to node (Lustre mounted with ``localflock``,
  NFS without its lock manager), so a lock that is free while its recorded holder looks
  alive is refused too: on this host, when the holder's process is alive; on another, when
  its heartbeat is younger than ``STALE`` seconds. An earlier attempt of the same SLURM job
  (a requeue, an in-job restart) is never alive, so its lock is taken over.

A run that ends removes the lock file (and the run directory, if the lock made it and
nothing else was written: a run refused early leaves nothing behind); a run killed leaves the
file with a dead holder, which the next run takes over (``taken_over`` names it).

``check_not_in_use`` asks the same question without taking the lock or writing anything:
``t2train launch`` refuses a live run directory with it before any worker starts. Imports
nothing of t2train but its errors: the launcher and the trainer share it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Optional, TextIO

from t2train.errors import UserInputError

LOCK_FILE = "t2train.lock"
HEARTBEAT = 30.0  # seconds between touches of the lock file
STALE = 3 * HEARTBEAT  # a holder on another host with an older heartbeat is gone


class RunDirectoryInUse(UserInputError):
    """Another run holds the run directory."""


def _holder() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": os.environ.get("SLURM_JOB_ID", ""),
        "started": time.time(),
    }


def _this_process() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()


def describe_holder(holder: dict) -> str:
    """A lock file's recorded holder in words: host, pid, SLURM job, start."""
    job = f", SLURM job {holder['job']}" if holder.get("job") else ""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, started {started}"


def _refusal(path: Path, holder: dict, why: str) -> str:
    return (
        f"run directory {path.parent} is in use by another run ({describe_holder(holder)}; {why}): "
        "wait for it to end, or give this run another name. Nothing was written. (If that run "
        f"is gone, delete {path}.)"
    )


def _recorded(lock: TextIO) -> dict:
    lock.seek(0)
    try:
        return json.loads(lock.read() or "{}")
    except ValueError:
        return {}


def check_not_in_use(run_dir: Path) -> None:
    """Raise ``RunDirectoryInUse`` when a live run holds ``run_dir``'s lock, as ``RunLock``
    would, but without taking it or writing anything (a shared flock, released at once)."""
    path = run_dir / LOCK_FILE
    try:
        lock = open(path)
    except FileNotFoundError:
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirectoryInUse(_refusal(path, _recorded(lock), "it holds its lock")) from None
        holder = _recorded(lock)
        why = _alive_elsewhere(holder, time.time() - os.fstat(lock.fileno()).st_mtime)
        if why is not None:
            raise RunDirectoryInUse(_refusal(path, holder, why))


def _alive_elsewhere(holder: dict, heartbeat_age: float) -> Optional[str]:
    """Why the holder recorded in a lock file that ``flock`` let us take may still run, or
    None if it has ended."""
    if not holder or (holder.get("job") and holder["job"] == os.environ.get("SLURM_JOB_ID")):
        return None  # no holder, or an earlier attempt of this very job
    if (holder.get("host"), holder.get("pid")) == _this_process():
        return None  # this very process: an earlier run in it that did not release the lock
    if holder.get("host") == socket.gethostname():
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return None
        except (PermissionError, KeyError, ValueError, TypeError):
            pass  # another user's live process, or a malformed record: assume alive
        return "its process is alive on this host"
    if heartbeat_age < STALE:
        return (
            f"its heartbeat is {heartbeat_age:.0f} s old (a run touches it every "
            f"{HEARTBEAT:.0f} s; one older than {STALE:.0f} s has ended)"
        )
    return None


class RunLock:
    """The run directory's lock, held until ``release``. ``taken_over``: the holder recorded
    by a run that ended without releasing it (killed), else None."""

    def __init__(self, run_dir: Path):
        self.made_dir = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_FILE
        self._file: Optional[TextIO] = None
        self.taken_over: Optional[dict] = None
        try:
            self._open_locked()
            self._take()
        except BaseException:
            if self._file is not None:
                self._file.close()
            self._remove_dir()
            raise
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="t2train-run-lock")
        self._beat.start()

    def _open_locked(self) -> None:
        """Open and flock the lock file; again if the holder removed it meanwhile (the lock
        would be on a file nobody else opens)."""
        while True:
            self._file = lock = open(self.path, "a+")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _recorded(lock)
                lock.close()
                self._file = None
                raise RunDirectoryInUse(_refusal(self.path, holder, "it holds its lock")) from None
            try:
                if os.stat(self.path).st_ino == os.fstat(lock.fileno()).st_ino:
                    return
            except FileNotFoundError:
                pass
            lock.close()

    def _lock_file(self) -> TextIO:
        if self._file is None:
            raise RuntimeError(f"{self.path}: not open")
        return self._file

    def _take(self) -> None:
        lock = self._lock_file()
        holder = _recorded(lock)
        why = _alive_elsewhere(holder, time.time() - os.fstat(lock.fileno()).st_mtime)
        if why is not None:
            raise RunDirectoryInUse(_refusal(self.path, holder, why))
        if holder and (holder.get("host"), holder.get("pid")) != _this_process():
            self.taken_over = holder
        lock.seek(0)
        lock.truncate()
        lock.write(json.dumps(_holder()) + "\n")
        lock.flush()
        os.fsync(lock.fileno())

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            try:
                os.utime(self.path)
            except OSError:  # the directory moved or vanished: nothing to keep alive
                return

    def release(self) -> None:
        """Remove the lock file (still holding it) and the run directory if the lock made it
        and it is empty, then let go."""
        self._stop.set()
        self._beat.join()
        try:
            self.path.unlink(missing_ok=True)
            self._remove_dir()
        finally:
            self._lock_file().close()  # closing releases the flock

    def _remove_dir(self) -> None:
        if self.made_dir:
            try:
                self.path.parent.rmdir()
            except OSError:  # not empty: the run wrote into it
                pass
