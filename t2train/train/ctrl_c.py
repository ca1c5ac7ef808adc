"""Ctrl-C during training: the first asks for a saved stop, a second stops at once.

The first SIGINT is a stop request like SIGTERM (``StopGuard``: the ranks agree at the next
step boundary, save that step and exit with the requeue code), announced at once in one line
so the user knows the save is coming. A second one, pressed after ``REPEAT_AFTER_S``, raises
``KeyboardInterrupt`` in the main thread: no save, exit code 130.

SIGINT stays blocked in the main thread, as every stop signal (the processes the trainer
starts inherit the block and survive the terminal's SIGINT to the whole process group, see
``preemption.py``), so a thread started after the block waits for it. A thread started before
it (``import torch`` starts some) may receive it instead; Python then runs the handler set here
in the main thread. Under ``t2train launch`` a worker receives each Ctrl-C twice within
milliseconds (from the terminal and forwarded by the launcher): deliveries closer together
than ``REPEAT_AFTER_S`` count as one press.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

from t2train.signals import take_pending

REPEAT_AFTER_S = 1.0
FIRST_PRESS = (
    "Ctrl-C: saving a checkpoint after this step, then stopping (exit code {code}); "
    "press Ctrl-C again to stop at once without saving"
)


class CtrlC:
    """Use as a context manager while SIGINT is blocked in the main thread (``StopGuard``).

    ``on_first()`` runs once, at the first press; ``announce`` prints its one line.
    """

    def __init__(self, on_first: Callable[[], None], announce: bool, requeue_code: int):
        self.on_first = on_first
        self.announce = announce
        self.requeue_code = requeue_code
        self.first_press: Optional[float] = None
        self.stop_now = False
        self._done = threading.Event()
        self._waiter = threading.Thread(target=self._wait, daemon=True, name="t2train-ctrl-c")
        self._saved_handler: Any = None  # what signal.signal returned

    def __enter__(self) -> "CtrlC":
        self._saved_handler = signal.signal(signal.SIGINT, self._handle)
        self._waiter.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._waiter.join()
        signal.signal(signal.SIGINT, self._saved_handler)

    def _wait(self) -> None:
        while not self._done.is_set():
            if take_pending([signal.SIGINT], 0.1) is not None:
                self.pressed()
                if self.stop_now:
                    _thread.interrupt_main()  # runs _handle in the main thread

    def _handle(self, _signum, _frame) -> None:
        if not self.stop_now:
            self.pressed()
        if self.stop_now:
            raise KeyboardInterrupt

    def pressed(self) -> None:
        now = time.monotonic()
        if self.first_press is None:
            self.first_press = now
            self.on_first()
            if self.announce:
                print(FIRST_PRESS.format(code=self.requeue_code), file=sys.stderr, flush=True)
        elif now - self.first_press >= REPEAT_AFTER_S:
            self.stop_now = True


def announces() -> bool:
    """Whether this process prints the Ctrl-C line: global rank 0 (from the environment, as
    ``quiet_other_ranks``)."""
    return os.environ.get("RANK", "0") == "0"
