"""The launcher owns its process tree (t2train/processes.py): orphans are adopted and ended,
and megatron-core still keeps its checkpoint result queue where t2train starts it."""

from __future__ import annotations

import inspect
import subprocess
import sys

import psutil

from t2train.compat import megatron_writer

ADOPT_AND_END = """
import os, subprocess, sys
from t2train.processes import become_subreaper, end_descendants
assert become_subreaper()
# A child starts a grandchild that blocks SIGTERM (as a trainer's helpers do), then exits.
orphaner = ("import signal, subprocess, sys; "
            "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM]); "
            "print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
child = subprocess.run([sys.executable, "-c", orphaner], capture_output=True, text=True)
grandchild = int(child.stdout)
print(grandchild, __import__("psutil").Process(grandchild).ppid() == os.getpid(), flush=True)
print("|".join(end_descendants()))
"""


def test_the_launcher_adopts_and_ends_what_a_dead_child_left():
    proc = subprocess.run(
        [sys.executable, "-c", ADOPT_AND_END], capture_output=True, text=True, timeout=120
    )
    lines = proc.stdout.splitlines()
    grandchild = int(lines[0].split()[0]) if lines else None
    try:
        assert proc.returncode == 0, proc.stderr
        assert lines[0].split()[1] == "True"  # adopted, not re-parented to pid 1
        assert "time.sleep(300)" in lines[1]
        assert (
            not psutil.pid_exists(grandchild)
            or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
        )
    finally:
        if grandchild and psutil.pid_exists(grandchild):
            psutil.Process(grandchild).kill()


def test_megatron_still_makes_its_result_queue_only_when_none_exists():
    import importlib

    for module, name in megatron_writer.PATCHED:
        writer = importlib.import_module(module)
        assert hasattr(writer, name), f"{module}.{name} is gone: revisit compat/megatron_writer"
        source = inspect.getsource(writer._get_write_results_queue)
        assert f"if {name} is None" in source and f"return {name}" in source, source


UNGUARDED_SAVER = """
import importlib, os, sys
from t2train.compat.megatron_writer import MODULE, start_results_queue
from t2train.processes import die_with_parent

with open(sys.argv[1], "a") as runs:  # every execution of this file's top level
    print(os.getpid(), file=runs)
start_results_queue(die_with_parent)
queue = importlib.import_module(MODULE)._results_queue
queue.put("written")
print(queue.get(timeout=30))
"""


def test_the_result_queue_server_does_not_run_the_trainers_main_again(tmp_path):
    """spawn would import the script again in the queue's server: a script without a
    ``__main__`` guard would run again there (and one importing the stack pays its imports)."""
    script, runs = tmp_path / "saver.py", tmp_path / "runs.txt"
    script.write_text(UNGUARDED_SAVER)
    proc = subprocess.run(
        [sys.executable, str(script), str(runs)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["written"]
    assert len(runs.read_text().split()) == 1, runs.read_text()


ASYNC_SAVER = """
import time
import psutil
from t2train.compat.megatron_writer import start_results_queue
from t2train.processes import die_with_parent
start_results_queue(die_with_parent)
children = psutil.Process().children()
print(*[c.pid for c in children if "spawn_main" in " ".join(c.cmdline())], flush=True)
time.sleep(300)
"""


def test_the_result_queue_server_dies_with_its_trainer():
    """The server of an asynchronous save's results blocks stop signals, as the trainer does;
    when the trainer is killed, its parent-death signal ends it."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", ASYNC_SAVER], stdout=subprocess.PIPE, text=True
    )
    try:
        [server] = map(int, trainer.stdout.readline().split())
        assert psutil.Process(server).ppid() == trainer.pid
    finally:
        trainer.kill()
        trainer.wait(timeout=30)
    try:
        psutil.Process(server).wait(timeout=30)
    except psutil.NoSuchProcess:
        pass  # already reaped
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE


FORKING_TRAINER = """
import multiprocessing, threading, time
from t2train.processes import forked_children_die_with_this_process
forked_children_die_with_this_process()
context = multiprocessing.get_context("fork")
main = context.Process(target=time.sleep, args=(300,), daemon=True)  # as a checkpoint writer
main.start()
other = [context.Process(target=time.sleep, args=(300,))]
thread = threading.Thread(target=other[0].start)  # forked from another thread: left alone
thread.start(); thread.join()
print(main.pid, other[0].pid, flush=True)
time.sleep(300)
"""


def test_what_a_trainer_forks_dies_with_it():
    """A child forked from the trainer's main thread (megatron-core's checkpoint writers) dies
    when the trainer is killed; one forked from another thread is left alone."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", FORKING_TRAINER], stdout=subprocess.PIPE, text=True
    )
    try:
        main, other = map(int, trainer.stdout.readline().split())
    finally:
        trainer.kill()
        trainer.wait(timeout=30)
    try:
        try:
            psutil.Process(main).wait(timeout=30)
        except psutil.NoSuchProcess:
            pass
        assert not psutil.pid_exists(main) or psutil.Process(main).status() == psutil.STATUS_ZOMBIE
        assert psutil.pid_exists(other) and psutil.Process(other).status() != psutil.STATUS_ZOMBIE
    finally:
        for pid in (main, other):
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()
