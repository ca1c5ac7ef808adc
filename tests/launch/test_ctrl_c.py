"""Ctrl-C: in training the first saves and stops with the requeue code, a second stops at once;
any other command ends with one line (exit code 130)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from test_stop_guard import _stop_reason
from tiny_run import TINY_MODEL

from t2train.cli import main as t2train_main
from t2train.monitor.metrics import Monitor
from t2train.signals import REQUEUE_EXIT_CODE
from t2train.train import ctrl_c
from t2train.train.preemption import StopGuard

from proc_signals import has, signal_masks
from suite_budget import patient


@pytest.mark.slow
def test_ctrl_c_in_training_saves_the_step_and_exits_with_the_requeue_code(
    megatron_world, shakespeare, tmp_path, monkeypatch, capsys
):
    progress = Monitor.progress

    def press_ctrl_c_at_the_first_progress_line(self, step, *args):
        progress(self, step, *args)
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Monitor, "progress", press_ctrl_c_at_the_first_progress_line)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite runs as a background job
    run_dir = tmp_path / "run"
    code = t2train_main(
        [
            "train",
            *TINY_MODEL,
            f"data.path={shakespeare}",
            f"log.run_dir={run_dir}",
            "train.steps=50",
            "checkpoint.interval=50",
            "train.eval_interval=50",
            "log.diagnostics_interval=0",
        ]
    )
    out, err = capsys.readouterr()
    assert code == REQUEUE_EXIT_CODE
    # The press is seen at the end of step 1 or, if it lands a moment later, of step 2.
    saved = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert saved in ("step_00000001", "step_00000002")
    assert err.splitlines() == [ctrl_c.FIRST_PRESS.format(code=REQUEUE_EXIT_CODE)], err
    assert f"stopped early at step {int(saved[5:])} (received SIGINT)" in out
    assert signal.getsignal(signal.SIGINT) is before  # the run's handler is gone


def test_a_second_ctrl_c_stops_at_once_and_a_doubled_delivery_counts_once(
    megatron_world, monkeypatch
):
    monkeypatch.setattr(ctrl_c, "REPEAT_AFTER_S", 0.3)
    with pytest.raises(KeyboardInterrupt):
        with StopGuard([signal.SIGTERM, signal.SIGINT], exit_duration_mins=0) as guard:
            # Under `t2train launch` a worker gets each press twice (terminal and launcher).
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            assert _stop_reason(guard) == "received SIGINT"
            time.sleep(0.5)  # still training: the doubled delivery was one press
            os.kill(os.getpid(), signal.SIGINT)
            deadline = time.monotonic() + patient(10)
            while time.monotonic() < deadline:  # the main thread is interrupted in here
                time.sleep(0.01)
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_ctrl_c_in_any_command_is_one_line_and_exit_code_130(monkeypatch, capsys):
    import t2train.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_config", interrupted)
    assert t2train_main(["config", "--preset", "tiny"]) == 130
    assert capsys.readouterr().err == "t2train config: interrupted by Ctrl-C (exit code 130)\n"


@pytest.mark.slow
def test_ctrl_c_in_data_prepare_is_one_line_and_leaves_nothing(shakespeare, tmp_path):
    """Ctrl-C from a terminal reaches the whole process group: the tokenizing workers too."""
    text = tmp_path / "big.txt"
    text.write_text("To be, or not to be, that is the question. " * 200_000)  # 9 MB
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "t2train.cli",
            "data",
            "prepare",
            "--input",
            str(text),
            "--out",
            str(out),
            "--tokenizer",
            str(shakespeare / "tokenizer.json"),
            "--seq-length",
            "64",
            "--workers",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # a shell's background job ignores SIGINT, and a child would inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + patient(120)
        while _workers(proc.pid) < 2 or _ignores_sigint(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130
    assert err.splitlines() == ["t2train data: interrupted by Ctrl-C (exit code 130)"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt"]


def _ignores_sigint(pid: int) -> bool:
    """While it starts a worker the parent ignores SIGINT for a few milliseconds (the worker
    inherits that, data/tokenize.py); a Ctrl-C then may be lost if a thread other than the
    main one takes it. The test presses it once the parent listens again."""
    try:
        return has(signal_masks(pid)["SigIgn"], signal.SIGINT)
    except FileNotFoundError:  # it has exited: the caller's poll() says so
        return False


def _workers(pid: int) -> int:
    try:
        return sum(
            "spawn_main" in " ".join(child.cmdline()) for child in psutil.Process(pid).children()
        )
    except psutil.NoSuchProcess:
        return 0
