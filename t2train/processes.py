"""The launcher owns every process of its run, so none outlives it.

A trainer starts helper processes (dist-checkpointing's writers and the server of their result
queue, multiprocessing's resource tracker, data loader workers) that hold the stop signals
blocked or ignore them (``t2train/signals.py``). When a trainer is killed (``kill -9``, the
OOM killer) they are re-parented, to pid 1 by default, and nothing ends them: on a cluster
without cgroup process tracking they hold the job's output open (SLURM: "Abandoning IO") and
their memory and shared memory after the job. Three things prevent that (Linux ``prctl``):

- ``become_subreaper``: ``t2train launch`` adopts the orphans of its tree instead of pid 1,
  and ``end_descendants`` ends whatever is left once its workers have ended, or when it exits;
- ``die_with_parent``: a worker dies with its launcher, and an async save's result server with its
  trainer (a parent-death signal), even when the parent is killed with SIGKILL;
  ``forked_children_die_with_this_process`` gives the same signal to what the trainer forks (a
  fork does not inherit it): a checkpoint writer forked by a trainer killed mid-save lived
  on, blocked, holding the trainer's sockets, so the ranks of other nodes waited for it in
  their collectives instead of failing;
- multiprocessing's resource tracker is left a moment to end by itself (it unlinks the shared
  memory its dead clients left) before it is killed too.

Imports nothing of t2train: the launcher and the trainer share it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Iterable

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# The launcher's pid, in the environment of the workers it starts.
LAUNCHER_PID = "T2TRAIN_LAUNCHER_PID"


def _prctl(option: int, value: int) -> bool:
    """Whether the call succeeded (not Linux: nothing to do, False)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def become_subreaper() -> bool:
    """Orphaned descendants of this process become its children (not pid 1's)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent (``parent_pid``) ends; exit now if it already
    has (this process then has another parent)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(128 + signal.SIGKILL)


_forks_die_with_parent: list = []  # the hook, once registered in this process


def forked_children_die_with_this_process() -> None:
    """Every child this process forks from its main thread (which lives as long as the
    process) dies with it: megatron-core's checkpoint writers, data loader workers. A
    parent-death signal follows the thread that forked, so forks from other threads are left
    alone. Registered once per process."""
    if _forks_die_with_parent:
        return
    fork = {}

    def before() -> None:
        fork["pid"] = os.getpid()
        fork["main_thread"] = threading.current_thread() is threading.main_thread()

    def after_in_child() -> None:
        if fork.get("main_thread"):
            die_with_parent(fork["pid"])

    os.register_at_fork(before=before, after_in_child=after_in_child)
    _forks_die_with_parent.append(after_in_child)


def die_with_launcher() -> None:
    """In a worker of ``t2train launch``: die with the launcher."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher:
        die_with_parent(int(launcher))


def _is_resource_tracker(process) -> bool:
    try:
        return "multiprocessing.resource_tracker" in " ".join(process.cmdline())
    except Exception:  # psutil.Error: it ended, or became a zombie
        return False


def end_descendants(spare: Iterable[int] = (), tracker_grace_s: float = 5.0) -> list[str]:
    """Kill every process below this one except ``spare`` (pids) and wait for them; returns
    the command lines of those that were still running.

    Resource trackers are killed last, after ``tracker_grace_s`` to end by themselves: a
    tracker ends once its clients are gone, unlinking the shared memory they left.
    """
    import psutil  # noqa: PLC0415 - psutil: when a process tree is ended

    spare = set(spare)
    me = psutil.Process()
    ended = []

    def still_running() -> list:
        found = []
        for process in me.children(recursive=True):
            try:
                if process.pid not in spare and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
            except psutil.NoSuchProcess:
                pass
        return found

    def kill(processes: list) -> None:
        for process in processes:
            try:
                ended.append(" ".join(process.cmdline()) or process.name())
                process.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(processes, timeout=10)

    kill([p for p in still_running() if not _is_resource_tracker(p)])
    deadline = time.monotonic() + tracker_grace_s
    while (trackers := still_running()) and time.monotonic() < deadline:
        time.sleep(0.05)
    kill(trackers)
    _reap()
    return ended


def _reap() -> None:
    """Collect the exit status of adopted children that ended (no zombies left)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
