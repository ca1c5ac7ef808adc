"""Progress of a long pass over the inputs: a bar on a terminal, a line now and then in a log.

A batch job's log gets no use from a progress bar (it only appears at the end, or as noise),
so there a line is printed every ``every`` seconds instead, as ``t2train train`` prints one
every few steps.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, TextIO

from tqdm import tqdm


@contextmanager
def progress_meter(
    what: str, total: int, bar: bool = False, every: float = 0.0, out: Optional[TextIO] = None
) -> Iterator[Callable[[int], None]]:
    """Yields ``update(done)``, ``done`` being the bytes of ``total`` processed so far: a bar
    on stderr with ``bar``, else a line on ``out`` (stdout) at most every ``every`` seconds
    (0: silent)."""
    if bar:
        with tqdm(total=total, desc=what, unit="B", unit_scale=True) as meter:
            yield lambda done: meter.update(done - meter.n)
    elif every > 0:
        yield _Lines(what, total, every, out or sys.stdout).update
    else:
        yield lambda done: None


class _Lines:
    def __init__(self, what: str, total: int, every: float, out: TextIO):
        self.what, self.total, self.every, self.out = what, max(total, 1), every, out
        self.start = self.last = time.monotonic()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last, elapsed = now, now - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = f"{(self.total - done) / rate:.0f}s" if rate > 0 else "?"
        print(
            f"{self.what}: {100 * done / self.total:3.0f}% ({_mb(done)} of {_mb(self.total)}),"
            f" {_mb(rate)}/s, {elapsed:.0f}s elapsed, eta {eta}",
            file=self.out,
            flush=True,
        )


def _mb(count: float) -> str:
    return f"{count / 1e6:,.1f} MB"
