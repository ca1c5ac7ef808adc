"""Leave at once, from any thread, without leaving orphans.

A rank that must end while its main thread is blocked in a collective (the watchdog, a
peer's failure) cannot unwind, so it calls ``os._exit``. That alone would leave the processes
it started running: dist-checkpointing's writer processes and the server of their result
queue hold the stop signals blocked (``preemption.py``) and nothing tells them to end, so they
would live on and keep the job's output pipes open. They are killed first. multiprocessing's
resource tracker is spared: it ends by itself once this process is gone, and unlinks the
shared memory left behind on its way out.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    from multiprocessing import resource_tracker  # noqa: PLC0415 - on a hard exit only

    import psutil  # noqa: PLC0415 - on a hard exit only

    sys.stdout.flush()
    sys.stderr.flush()
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    for child in psutil.Process().children(recursive=True):
        if child.pid != tracker:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
    os._exit(code)
