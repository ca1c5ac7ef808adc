"""Stop a run early, with a checkpoint, before the job around it ends.

A cluster ends jobs with a signal (SLURM: ``--signal=USR1@N`` before the time limit,
SIGTERM on preemption or ``scancel``) or simply at a wall-clock limit. ``StopGuard`` turns
both into a decision the ranks take together at a step boundary: every rank contributes a
flag to one all-reduce, so all of them stop after the same step, save it through the normal
checkpoint path and leave with ``REQUEUE_EXIT_CODE``, which the job script answers by
requeueing itself.

Signals are *blocked* and polled rather than only handled: SLURM delivers them to every
process of the job step, and a blocked signal mask is inherited by every child process,
including the ones started with ``spawn`` (dist-checkpointing's writer queue). A handled
signal would be reset to its default action in those children and kill them. ``t2train
launch`` blocks the signals before torchrun starts, so they are blocked in every worker from
its first instruction; a trainer started another way blocks them when the guard opens and
also records them with a handler, in case a thread created earlier receives one
(``t2train/signals.py`` parses the signals and blocks them). SIGINT (Ctrl-C) is one of them by
default; a second Ctrl-C stops at once (``ctrl_c.py``).
"""

from __future__ import annotations

import signal
import time
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from t2train.parallel.init import current_device
from t2train.signals import REQUEUE_EXIT_CODE, block, take_pending
from t2train.train.ctrl_c import CtrlC, announces


class StopGuard:
    """Collects stop requests (signals, elapsed time) and agrees on them across ranks.

    Use as a context manager around the run; ``should_stop`` is a collective.
    """

    def __init__(self, signals: Iterable[signal.Signals], exit_duration_mins: float):
        self.signals = list(signals)
        self.exit_duration_s = exit_duration_mins * 60
        self.started = time.monotonic()
        self._received: Optional[signal.Signals] = None
        self._saved_handlers: dict = {}
        self._saved_mask: set = set()
        # Polled at step boundaries; SIGINT is waited for by CtrlC, which announces it.
        self._polled: list[signal.Signals] = [sig for sig in self.signals if sig != signal.SIGINT]
        self._ctrl_c = (
            CtrlC(lambda: self._record(signal.SIGINT, None), announces(), REQUEUE_EXIT_CODE)
            if signal.SIGINT in self.signals
            else None
        )

    def __enter__(self) -> "StopGuard":
        self.started = time.monotonic()
        self._saved_mask = block(self.signals)
        for sig in self._polled:
            self._saved_handlers[sig] = signal.signal(sig, self._record)
        if self._ctrl_c is not None:
            self._ctrl_c.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._ctrl_c is not None:
            self._ctrl_c.__exit__(*exc)
        # A signal still pending would fire under the restored handler: consume it.
        while self.signals and take_pending(self.signals, 0) is not None:
            pass
        for sig, handler in self._saved_handlers.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, self._saved_mask)

    def _record(self, signum, _frame) -> None:
        self._received = signal.Signals(signum)

    def _local_request(self) -> int:
        """0: carry on; 1: out of time; 2 + i: received ``self.signals[i]``."""
        delivered = take_pending(self._polled, 0) if self._polled else None
        if delivered is not None:
            self._received = delivered
        if self._received is not None:
            return 2 + self.signals.index(self._received)
        if self.exit_duration_s and time.monotonic() - self.started >= self.exit_duration_s:
            return 1
        return 0

    def should_stop(self) -> Optional[str]:
        """Collective: why every rank stops now (a signal name or the time limit), or None."""
        flag = torch.tensor([self._local_request()], dtype=torch.int64, device=current_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        code = int(flag.item())
        if code == 0:
            return None
        if code == 1:
            return f"train.exit_duration_mins={self.exit_duration_s / 60:g} reached"
        return f"received {self.signals[code - 2].name}"
