"""Where megatron-core's checkpoint writer sends its results: in the saving process for a
synchronous save, and to a server that dies with its trainer for an asynchronous one.

megatron-core's filesystem writer (every torch_dist save, sync or async) collects its
writers' results through a queue served by a ``multiprocessing`` Manager that it spawns on
the first save (``filesystem_async._get_write_results_queue``) and keeps for the life of the
trainer, with no way to configure it. Two things follow.

* A synchronous save writes from the saving process (its write processes are forked and
  joined within the save), so the server only costs: a process spawned at the first save,
  which imports torch to unpickle the results (seconds of CPU beside the ranks).
  ``results_in_process`` gives such a save a plain in-process queue instead.
* An asynchronous save writes from another process, so it needs the server. That server
  inherits the trainer's blocked stop signals, as it must (a SIGTERM to every process of a
  job would otherwise kill it in the middle of the final save, ``t2train/signals.py``), so
  when the trainer was killed nothing ended it: it lived on, re-parented to pid 1, after the
  job. ``start_results_queue`` makes that queue first, from a Manager whose server runs
  ``initializer`` before serving (t2train gives it a parent-death signal,
  ``t2train.processes.die_with_parent``), spawned without the trainer's ``__main__``
  (``_main_module_hidden``).

``PATCHED`` is the contract with megatron-core; ``tests/launch/test_process_tree.py`` fails if
the name moves or megatron-core stops using it.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import queue
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.managers import SyncManager
from typing import Callable

MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"
PATCHED = ((MODULE, "_results_queue"),)


@contextmanager
def results_in_process() -> Iterator[None]:
    """Around a synchronous ``dist_checkpointing.save``: its results go through a queue of
    this process. An asynchronous save already under way keeps the queue it was given."""
    writer = importlib.import_module(MODULE)
    before = getattr(writer, "_results_queue")
    setattr(writer, "_results_queue", queue.Queue())
    try:
        yield
    finally:
        setattr(writer, "_results_queue", before)


def start_results_queue(initializer: Callable[[int], None]) -> None:
    """Unless megatron-core already has one: its result queue, served by a spawned process
    that first runs ``initializer(trainer_pid)``. Call it from the thread that saves (a
    parent-death signal follows the thread that started the process)."""

    writer = importlib.import_module(MODULE)
    if getattr(writer, "_results_queue") is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    with _main_module_hidden():
        manager.start(initializer, (os.getpid(),))
    setattr(writer, "_results_queue", manager.Queue())  # the proxy keeps its manager alive


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """A spawned process first imports its parent's ``__main__`` again (by module name, or by
    path for a script), which the queue's server never uses: a script that imports the stack
    at its top cost every saving process seconds more (5 s here), and one without a
    ``__main__`` guard would run again in the server. While the server is started,
    ``__main__`` is an empty module, so spawn has nothing to import."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")  # no __spec__, no __file__
    try:
        yield
    finally:
        sys.modules["__main__"] = main
