"""The trainer's stop guard: signals and the time limit end a run at a step boundary with a
checkpoint and the requeue exit code (in-process, one rank)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from tiny_run import TINY_MODEL

from t2train.cli import main as t2train_main
from t2train.config.loader import load_config
from t2train.config.schema import ConfigError
from t2train.signals import REQUEUE_EXIT_CODE, parse_signals
from t2train.train.preemption import StopGuard


def test_a_signal_is_held_until_the_step_boundary_and_handlers_are_restored(megatron_world):
    before = signal.getsignal(signal.SIGUSR2)
    with StopGuard([signal.SIGUSR1, signal.SIGUSR2], exit_duration_mins=0) as guard:
        assert guard.should_stop() is None
        os.kill(os.getpid(), signal.SIGUSR2)  # blocked here: pending until the guard polls
        assert _stop_reason(guard) == "received SIGUSR2"
    assert signal.getsignal(signal.SIGUSR2) == before
    assert signal.SIGUSR2 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def _stop_reason(guard: StopGuard, wait_s: float = 10.0):
    """The guard's decision once the signal has arrived.

    A signal the main thread blocks may be delivered to another thread of this process
    (torch's, gloo's) that does not block it; Python then runs the guard's handler in the main
    thread a moment later, so poll for a bounded time instead of asserting at once.
    """
    deadline = time.monotonic() + wait_s
    while (reason := guard.should_stop()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return reason


def test_the_time_limit_stops_the_run(megatron_world):
    with StopGuard([], exit_duration_mins=1e-9) as guard:
        assert guard.should_stop() == "train.exit_duration_mins=1e-09 reached"


@pytest.mark.slow
def test_train_saves_and_exits_with_the_requeue_code_at_the_time_limit(
    megatron_world, shakespeare, tmp_path
):
    run_dir = tmp_path / "run"
    code = t2train_main(
        [
            "train",
            *TINY_MODEL,
            f"data.path={shakespeare}",
            f"log.run_dir={run_dir}",
            "train.steps=50",
            "train.exit_duration_mins=1e-9",
            "checkpoint.interval=50",
            "train.eval_interval=50",
        ]
    )
    assert code == REQUEUE_EXIT_CODE
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000001"


@pytest.mark.parametrize(
    "override, cause",
    [
        (
            "train.exit_signals=SIGKILL",
            "train.exit_signals='SIGKILL': 'SIGKILL' is not a catchable",
        ),
        ("train.exit_signals=USR1,BOGUS", "'BOGUS' is not a catchable signal name"),
        ("train.exit_duration_mins=-5", "train.exit_duration_mins=-5.0: must be >= 0"),
    ],
)
def test_bad_stop_settings_name_the_field(override, cause):
    with pytest.raises(ConfigError, match=cause):
        load_config(overrides=["data.path=d", override])


def test_signal_names_parse_with_or_without_the_prefix():
    assert parse_signals("usr1, SIGTERM") == [signal.SIGUSR1, signal.SIGTERM]
    assert parse_signals("") == []


def test_a_suspended_and_resumed_process_is_not_asked_to_stop(tmp_path):
    """SIGSTOP then SIGCONT (SLURM suspending and resuming a job, a debugger) interrupt the
    Ctrl-C waiter's ``sigtimedwait``, which CPython then answers with a siginfo of signal 0: it
    was taken for Ctrl-C, and the run saved and stopped. Now nothing is asked; a real SIGINT
    after it still is."""
    import subprocess
    import sys

    from t2train.signals import take_pending

    guarded = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time\n"
            "from t2train.parallel.init import init_distributed\n"
            "from t2train.train.preemption import StopGuard\n"
            "init_distributed()  # a world of one: should_stop is a collective\n"
            "with StopGuard([signal.SIGTERM, signal.SIGINT], exit_duration_mins=0) as guard:\n"
            "    print('guarded', flush=True)\n"
            "    sys.stdin.readline()\n"
            "    time.sleep(0.5)\n"
            "    print('after resume:', guard.should_stop(), flush=True)\n"
            "    sys.stdin.readline()\n"
            "    time.sleep(0.5)\n"
            "    print('after SIGINT:', guard.should_stop(), flush=True)\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_PORT")},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert guarded.stdout.readline() == "guarded\n"
        for stop in (signal.SIGSTOP, signal.SIGCONT) * 3:
            guarded.send_signal(stop)
            time.sleep(0.3)
        guarded.stdin.write("\n")
        guarded.stdin.flush()
        assert guarded.stdout.readline() == "after resume: None\n"
        guarded.send_signal(signal.SIGINT)
        guarded.stdin.write("\n")
        guarded.stdin.flush()
        assert guarded.stdout.readline() == "after SIGINT: received SIGINT\n"
    finally:
        guarded.kill()
        guarded.communicate()
    assert take_pending([signal.SIGUSR2], 0) is None  # nothing pending here
