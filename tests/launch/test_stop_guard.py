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
def test_train_saves_and_exits_with_the_requeue_code_at_the_time_limit(megatron_world, shakespeare,
                                                                       tmp_path):
    run_dir = tmp_path / "run"
    code = t2train_main(["train", *TINY_MODEL, f"data.path={shakespeare}", f"log.run_dir={run_dir}",
                         "train.steps=50", "train.exit_duration_mins=1e-9",
                         "checkpoint.interval=50", "train.eval_interval=50"])
    assert code == REQUEUE_EXIT_CODE
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000001"


@pytest.mark.parametrize("override, cause", [
    ("train.exit_signals=SIGKILL", "train.exit_signals='SIGKILL': 'SIGKILL' is not a catchable"),
    ("train.exit_signals=USR1,BOGUS", "'BOGUS' is not a catchable signal name"),
    ("train.exit_duration_mins=-5", "train.exit_duration_mins=-5.0: must be >= 0"),
])
def test_bad_stop_settings_name_the_field(override, cause):
    with pytest.raises(ConfigError, match=cause):
        load_config(overrides=["data.path=d", override])


def test_signal_names_parse_with_or_without_the_prefix():
    assert parse_signals("usr1, SIGTERM") == [signal.SIGUSR1, signal.SIGTERM]
    assert parse_signals("") == []
