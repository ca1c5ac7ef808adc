"""Stop signals: ``train.exit_signals`` parsed, held blocked across processes, and the exit
code of a run that saved and stopped early (``t2train/train/preemption.py`` polls them).

One piece of the standard library undoes the block: multiprocessing's resource tracker, when
it starts, unblocks SIGINT and SIGTERM in the thread that starts it (CPython's
``resource_tracker.ensure_running``), and it starts on first use of shared memory, a semaphore
or a spawned process (mosaicml-streaming, the checkpoint writers). The trainer's main thread
then spawned dist-checkpointing's writer processes with SIGTERM unblocked, and a SIGTERM to
every process of a SLURM step killed them in the middle of the final save. ``block`` starts
the tracker itself first (the tracker ignores both signals) and sets the mask after it.
"""

from __future__ import annotations

import signal
from typing import Iterable, Optional

from t2train.errors import ConfigError

# EX_TEMPFAIL (sysexits.h): the run saved a checkpoint and stopped early; run it again.
REQUEUE_EXIT_CODE = 75

_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}


def parse_signals(spec: str, field_name: str = "train.exit_signals") -> list[signal.Signals]:
    """``"SIGUSR1,SIGTERM"`` -> signals; an empty string means none."""
    names = [name.strip().upper() for name in spec.split(",") if name.strip()]
    signals = []
    for name in names:
        full = name if name.startswith("SIG") else "SIG" + name
        if full not in signal.Signals.__members__ or full in _UNCATCHABLE:
            raise ConfigError(
                f"{field_name}={spec!r}: {name!r} is not a catchable signal "
                "name; expected a comma-separated list like SIGUSR1,SIGTERM"
            )
        signals.append(signal.Signals[full])
    return signals


def block(signals: Iterable[signal.Signals]) -> set:
    """Hold ``signals`` pending in this thread and every thread or process it starts; returns
    the mask before. Starts multiprocessing's resource tracker first (see the module's doc),
    restoring the mask its start changes."""
    from multiprocessing import resource_tracker  # noqa: PLC0415 - when signals are first held

    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_SETMASK, before | set(signals))
    return before


def take_pending(signals: list[signal.Signals], timeout: float) -> Optional[signal.Signals]:
    """One of ``signals`` pending (blocked) for this thread, waiting up to ``timeout`` seconds,
    or None. A job suspended and resumed (SIGSTOP, SIGCONT: SLURM's suspend, a debugger)
    interrupts the wait, and CPython's ``sigtimedwait`` then returns a siginfo of signal 0:
    that is no signal (a trainer took it for Ctrl-C and stopped)."""
    info = signal.sigtimedwait(signals, timeout)
    if info is None or info.si_signo not in signals:
        return None
    return signal.Signals(info.si_signo)
