"""End a rank that makes no progress, naming where it is blocked (hung collectives).

The process-group timeout (``parallel.collective_timeout_mins``) is enforced by NCCL's
watchdog and by plain gloo operations, but not by gloo's coalesced all-reduce that
Megatron's DDP uses, nor by mosaicml-streaming's shared-memory waits: a dead or stuck peer
would hang the run forever. The training loop marks each phase (``phase``); when one lasts
longer than the timeout this thread prints which rank is stuck, in which phase, in which
torch.distributed call and from where, dumps the stack and exits with ``HUNG_EXIT_CODE``, so
torchrun (or ``t2train launch --max-restarts``) can restart the group from the last checkpoint.

Wall time alone does not tell a stuck process from a starved one: on a machine with more
runnable processes than cores, a healthy step may take longer than the timeout. The training
loop's thread (the main thread) blocked in a collective or a shared-memory wait uses next to
no CPU, so a phase is judged over windows of the timeout: one in which that thread used at
least ``MIN_CPU_SHARE`` of a core is slow progress, and the next window starts. Only a
window below it ends the rank, and the report says how much CPU the thread used. The
thread's own CPU time, not the process's: the data loader's, TensorBoard's and the
collectives' helper threads keep running while the loop is stuck.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from t2train.train.hard_exit import exit_now

HUNG_EXIT_CODE = 124
# The share of one core below which a window counts as no progress: a main thread blocked in a
# collective uses next to none; a starved one that progresses gets more.
MIN_CPU_SHARE = 0.02


def thread_cpu_seconds(native_id: int) -> float:
    """The CPU time of one thread of this process (Linux: ``/proc/self/task/<tid>/stat``);
    the whole process's where there is no such file."""
    try:
        stat = Path(f"/proc/self/task/{native_id}/stat").read_text()
    except OSError:
        return time.process_time()
    # After the command name's closing parenthesis: field 3 (the state) onward; utime and
    # stime are fields 14 and 15, in clock ticks.
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Watchdog:
    def __init__(self, timeout_minutes: float):
        self.timeout = timeout_minutes * 60
        self._main = threading.main_thread().ident
        self._main_native = threading.main_thread().native_id or 0
        self._phase: tuple[str, float, float] | None = None  # name, wall and CPU at its start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="t2train-watchdog")

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    @contextmanager
    def phase(self, name: str):
        """Time one phase of the loop (a training step, an evaluation, a save)."""
        self._phase = (name, time.monotonic(), self._cpu())
        try:
            yield
        finally:
            self._phase = None

    def _watch(self) -> None:
        watched, started, cpu = None, 0.0, 0.0  # the phase, and when its window started
        while not self._stop.wait(min(self.timeout / 10, 5.0)):
            phase = self._phase
            if phase is None:
                continue
            if phase is not watched:
                watched, started, cpu = phase, phase[1], phase[2]
            waited = time.monotonic() - started
            if waited <= self.timeout:
                continue
            used = self._cpu() - cpu
            if used >= MIN_CPU_SHARE * waited:  # slow, not stuck: judge the next window
                started, cpu = time.monotonic(), self._cpu()
                continue
            self._report(phase[0], waited, used)
            exit_now(HUNG_EXIT_CODE)

    def _cpu(self) -> float:
        """The training loop's (main thread's) CPU seconds so far."""
        return thread_cpu_seconds(self._main_native)

    def _report(self, phase: str, waited: float, used: float) -> None:
        frame = sys._current_frames().get(self._main or 0)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        cause = (
            "a peer rank is probably dead or stuck"
            if world > 1
            else "this process, alone in its run, is stuck where its stack shows"
        )
        print(
            f"rank {rank}: no progress for {self.timeout:g}s in {phase}, blocked in "
            f"{blocked_call(frame)} (parallel.collective_timeout_mins={self.timeout / 60:g}; "
            f"its main thread used {used:.2f} s of CPU in the last {waited:.1f} s); {cause}. "
            "Stack of this rank:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=False)


def blocked_call(frame) -> str:
    """``torch.distributed.<call> from <caller>`` for the innermost torch.distributed frame
    of a stack, else its innermost frame."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    for index, inner in enumerate(stack):
        if f"torch{os.sep}distributed{os.sep}" in inner.f_code.co_filename:
            outer = next(
                (
                    f
                    for f in stack[index:]
                    if f"torch{os.sep}distributed{os.sep}" not in f.f_code.co_filename
                    and "contextlib" not in f.f_code.co_filename
                ),
                None,
            )
            caller = f" from {_where(outer)}" if outer is not None else ""
            return f"torch.distributed {inner.f_code.co_name}{caller}"
    return _where(stack[0]) if stack else "an unknown place"


def _where(frame) -> str:
    path = Path(frame.f_code.co_filename)
    return f"{path.parent.name}/{path.name}:{frame.f_lineno} {frame.f_code.co_name}"
