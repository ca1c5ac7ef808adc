"""The hang watchdog (t2train/train/watchdog.py) in a real process: one that progresses
slowly because it gets little CPU (stopped and continued by the test, as a starved machine
schedules it) is not killed; one that is stuck is, and a world of one blames no peer."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from t2train.train.watchdog import HUNG_EXIT_CODE

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 2.0
# One phase that needs CPU_S of CPU ("busy") or sleeps SLEEP_S without using any ("stuck").
WATCHED = """
import sys, threading, time
from t2train.train.watchdog import Watchdog
def spin():
    while True:
        pass
if sys.argv[2] == "stuck beside a busy thread":  # as a data loader's thread keeps running
    threading.Thread(target=spin, daemon=True).start()
with Watchdog(float(sys.argv[1]) / 60) as dog:
    print("watching", flush=True)
    with dog.phase("training step 1"):
        if sys.argv[2] == "busy":
            end = time.process_time() + float(sys.argv[3])
            while time.process_time() < end:
                pass
        else:
            time.sleep(float(sys.argv[3]))
print("done", flush=True)
"""
CPU_S = 0.6
SLEEP_S = 30.0
RUN_S, STOPPED_S = 0.1, 0.4  # the starved process runs a fifth of the time at most


def _watched(mode: str, seconds: float) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", WATCHED, str(TIMEOUT_S), mode, str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert process.stdout.readline() == "watching\n", process.communicate()[1][-3000:]
    return process


def test_a_starved_process_that_progresses_is_not_killed_as_hung():
    """A phase that needs 0.6 s of CPU, in a process that runs 0.1 s of every 0.5 s: it
    takes several watchdog timeouts (2 s) of wall time, yet it used CPU in each of them, so
    it finishes. (The watchdog judged wall time alone, and killed it: exit 124.)"""
    process = _watched("busy", CPU_S)
    started = time.monotonic()
    try:
        while process.poll() is None and time.monotonic() - started < 120:
            time.sleep(RUN_S)
            process.send_signal(signal.SIGSTOP)
            time.sleep(STOPPED_S)
            process.send_signal(signal.SIGCONT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
            process.wait()
    took = time.monotonic() - started
    assert process.returncode == 0 and out == "done\n", (process.returncode, err[-3000:])
    assert took > 1.5 * TIMEOUT_S, f"not starved enough to test anything: {took:.1f} s"
    print(f"a phase of {CPU_S} s of CPU, starved, took {took:.1f} s of wall time")


@pytest.mark.parametrize("mode", ["stuck", "stuck beside a busy thread"])
def test_a_stuck_process_alone_in_its_run_is_killed_blaming_no_peer(mode):
    """A phase that sleeps (its main thread uses no CPU), alone or while another thread of
    the process spins: killed after the timeout with exit 124; the line says how much CPU
    the main thread used in the window and, as it has no peer, blames none. (Judged by the
    process's CPU time, the spinning thread kept the stuck one alive.)"""
    process = _watched(mode, SLEEP_S)
    try:
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == HUNG_EXIT_CODE, err[-3000:]
    line = err.splitlines()[0]
    used = re.search(
        r"^rank 0: no progress for 2s in training step 1, blocked in .* "
        r"\(parallel.collective_timeout_mins=0.0333333; its main thread used ([\d.]+) s of CPU in "
        r"the last ([\d.]+) s\); this process, alone in its run, is stuck where its stack "
        r"shows\. Stack of this rank:$",
        line,
    )
    assert used, line
    assert float(used[1]) < 0.02 * float(used[2]) and float(used[2]) >= TIMEOUT_S, line
    assert "peer" not in err, err[-3000:]
