"""`t2train launch` on one machine: real torchrun workers, bad launches, a stop signal.

A stop signal goes to the launcher process only (as ``kill PID`` or a container runtime
would send it), so the launcher must pass it on; or to every process of the launcher's tree
at once (SLURM's way: slurmstepd signals every process of the job step), so no helper
process (checkpoint writers, multiprocessing's resource tracker) may die of it.
test_slurm_jobs.py does the latter with a real ``scancel``; a signal to the launcher alone is
part of test_soak.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from tiny_run import TINY_MODEL, TWO_RANK_RUN, TWO_RANK_STEPS

from t2train.launch.plan import LaunchError, plan_standalone, processes_per_node
from t2train.launch.torchrun import exit_code
from t2train.signals import REQUEUE_EXIT_CODE

from proc_signals import has, signal_masks
from suite_budget import patient

REPO = Path(__file__).resolve().parents[2]


def _launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "t2train.launch", *args]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    return dict(env, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")  # one thread per process


def _train_args(data: Path, run_dir: Path, *extra: str) -> list[str]:
    """Runs use parallel.tensor=2 on 2 processes: one data reader (DP=1), so no two readers
    race for mosaicml-streaming's shared-memory prefix on a host where other jobs use it."""
    return [*TINY_MODEL, f"data.path={data}", f"log.run_dir={run_dir}", *extra]


def _logged_steps(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return []
    return [
        r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "train/loss" in r
    ]


def _losses(run_dir: Path) -> dict[int, float]:
    """Each step's last logged loss (a restarted run logs the steps after its checkpoint
    again)."""
    metrics = run_dir / "metrics.jsonl"
    records = map(json.loads, metrics.read_text().splitlines()) if metrics.is_file() else []
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def _start(data: Path, run_dir: Path, log: Path, nproc: int, *extra: str) -> subprocess.Popen:
    """``t2train launch`` in its own session, its output in ``log``."""
    with log.open("w") as out:
        return subprocess.Popen(
            _launch_cmd(f"--nproc-per-node={nproc}", *_train_args(data, run_dir, *extra)),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(),
            cwd=REPO,
            start_new_session=True,
        )


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, log: Path, step: int) -> None:
    deadline = time.monotonic() + patient(300)
    while max(_logged_steps(run_dir), default=0) < step:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.1)


RUN_TAG = "T2TRAIN_TEST_RUN"  # set in a launcher's environment: every process of its run has it


def run_processes(tag: str) -> list[str]:
    """The live processes (command lines) whose environment carries ``RUN_TAG=tag``: the
    launcher's, its workers' and their helpers', wherever they were re-parented."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if f"{RUN_TAG}={tag}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # not a process, or it ended
            continue
    return found


def wait_until_none_left(tag: str, seconds: float = 30) -> None:
    """A resource tracker ends a moment after its last client: allow that, no more."""
    deadline = time.monotonic() + patient(seconds)
    while (left := run_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the run outlived it: {left}"


def _worker(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "t2train.cli" in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker of rank {rank}")


@pytest.mark.slow
def test_standalone_launch_trains_and_restarts_a_killed_rank(shakespeare, tmp_path, uninterrupted):
    """The uninterrupted run (conftest.py) is the reference for a run whose rank 1 is
    SIGKILLed after step 4: ``--max-restarts=1`` restarts both workers, which resume from the
    newest checkpoint; every step's final loss equals the uninterrupted run's, bitwise.
    Nothing of the run outlives the launcher (the killed rank's checkpoint-queue server and
    resource tracker were re-parented to pid 1 and lived on)."""
    out, err = uninterrupted.stdout, uninterrupted.stderr
    assert "OMP_NUM_THREADS" not in err, err  # torchrun's banner is not shown
    assert "t2train launch: standalone | 1 node(s)" in out
    assert "2 process(es) per node | world size 2 | c10d rendezvous 127.0.0.1:" in out
    assert "TP 2 x PP 1 x DP 1" in out
    final = f"step_{TWO_RANK_STEPS:08d}"
    assert (uninterrupted.run_dir / "checkpoints" / "latest").read_text().strip() == final

    run_dir, log = tmp_path / "killed", tmp_path / "killed.log"
    with log.open("w") as out:  # a file, not a pipe: killed workers' children may keep it
        launcher = subprocess.Popen(
            _launch_cmd(
                "--nproc-per-node=2",
                "--max-restarts=1",
                *TWO_RANK_RUN,
                f"data.path={shakespeare}",
                f"log.run_dir={run_dir}",
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(_env(), **{RUN_TAG: str(run_dir)}),
            cwd=REPO,
        )
    deadline = time.monotonic() + patient(300)
    while max(_losses(run_dir), default=0) < 4:  # step 3 is saved, step 4 done
        assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    _worker(launcher, rank=1).send_signal(signal.SIGKILL)
    assert launcher.wait(timeout=600) == 0, log.read_text()[-6000:]
    wait_until_none_left(str(run_dir))
    text = log.read_text()
    assert "workers failed (exit code" in text and "restart 1 of 1" in text, text[-4000:]
    assert f"resumed from {run_dir / 'checkpoints'}/step_0000000" in text, text[-4000:]
    assert "FutureWarning" not in text, text  # Megatron's and DCP's on a checkpoint's load
    assert _losses(run_dir) == _losses(uninterrupted.run_dir)


def _start_nodes(
    tmp_path: Path,
    run_dir: Path,
    train: list[str],
    restarts=(0, 0),
    restart_timeout: float = 60.0,
    label: str = "",
    node_env: tuple[dict, dict] = ({}, {}),
    started: tuple[int, ...] = (0, 1),
    stagger: float = 0.0,
) -> tuple[list[subprocess.Popen], list[Path]]:
    """Two node launchers of one run on this host (tests/launch/node_launcher.py), each in
    its own session, their output in ``tmp_path/<label>node<N>.log``; node N restarts its
    workers up to ``restarts[N]`` times, with ``node_env[N]`` added to its environment.
    Only the nodes in ``started`` start, in that order, ``stagger`` seconds apart."""
    port, nodes, logs = plan_standalone(1, None).rdzv_port, [], []
    for node in started:
        if nodes:
            time.sleep(stagger)
        logs.append(tmp_path / f"{label}node{node}.log")
        with logs[-1].open("w") as out:
            nodes.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(Path(__file__).with_name("node_launcher.py")),
                        str(node),
                        str(port),
                        str(restarts[node]),
                        str(restart_timeout),
                        *train,
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    env=dict(_env(), **{RUN_TAG: str(run_dir)}, **node_env[node]),
                    start_new_session=True,
                )
            )
    return nodes, logs


def _kill_running(nodes: list[subprocess.Popen]) -> None:
    """After a test's node launchers, whether it passed or not: none may run on."""
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_node_that_outlives_the_rendezvous_host_exits_with_its_workers_code(
    shakespeare, tmp_path
):
    """Two nodes of one run on this host (tests/launch/node_launcher.py). Node 1's worker is
    paused and node 0's killed: node 0's launcher exits, taking the rendezvous store it hosts
    along, while node 1's agent still watches a live worker. Node 1's launcher then waits for
    its worker and exits with its code and one line (it raised RendezvousConnectionError out
    of torchrun: a long traceback and exit code 1, whatever its worker did)."""
    run_dir = tmp_path / "run"
    train = _train_args(
        shakespeare,
        run_dir,
        "parallel.tensor=2",
        "train.steps=400",
        "train.eval_interval=400",
        "checkpoint.interval=400",
        "log.diagnostics_interval=0",
        "parallel.collective_timeout_mins=0.25",
    )
    nodes, logs = _start_nodes(tmp_path, run_dir, train)
    paused = None
    try:
        _wait_for_step(nodes[0], run_dir, logs[0], 1)
        paused = _worker(nodes[1], rank=1)
        paused.suspend()
        _worker(nodes[0], rank=0).kill()
        assert nodes[0].wait(timeout=120) == 128 + signal.SIGKILL, logs[0].read_text()[-3000:]
        time.sleep(1)  # node 1's agent asks the gone store every 0.1 s meanwhile
        paused.resume()
        code = nodes[1].wait(timeout=300)
    finally:
        if paused is not None and paused.is_running():
            paused.resume()
        _kill_running(nodes)
    output = logs[1].read_text()
    assert "rendezvous.api.RendezvousConnectionError:" not in output, output[-6000:]
    # libtorch's store warnings, a C++ stack each, are off (TORCH_CPP_LOG_LEVEL=ERROR)
    assert "Exception raised from" not in output, output[-6000:]
    said = [line for line in output.splitlines() if line.startswith("t2train launch:")]
    # what a worker left running (a helper process still ending) is ended after the verdict,
    # and the launcher says so
    while said and re.fullmatch(
        r"t2train launch: ended \d+ process\(es\) the workers .*", said[-1]
    ):
        said.pop()
    assert re.fullmatch(
        rf"t2train launch: workers failed \(rank 1 exited with code {code}\); "
        rf"exit code {code}",
        said[-1],
    ), (said, code)
    wait_until_none_left(str(run_dir))


EXPECTED_NODES = "2 nodes expected (node0, node1), one `t2train launch` on each"


@pytest.mark.slow
@pytest.mark.parametrize(
    "alone, error",
    [
        (
            0,
            "not every node joined the rendezvous at 127.0.0.1:{port} within 3 s "
            f"(--join-timeout): {EXPECTED_NODES}; this is node 0",
        ),
        (
            1,
            "node 0 (node0), which hosts the rendezvous at 127.0.0.1:{port}, could not be "
            "reached within 3 s (--join-timeout; ConnectionRefusedError: Connection refused): "
            f"{EXPECTED_NODES}; this is node 1",
        ),
    ],
    ids=["host-alone", "other-alone"],
)
def test_a_start_that_a_node_never_joins_ends_in_one_line(shakespeare, tmp_path, alone, error):
    """One node of two starts alone: after ``--join-timeout`` it stops with one error line
    saying where it waited and for which nodes, exit code 2, and nothing of it runs on.
    Node 0 (the rendezvous host) alone printed torchrun's RendezvousTimeoutError traceback;
    node 1 alone waited torchrun's own 60 s whatever --join-timeout said, and logged the
    failed connection with a C++ stack."""
    run_dir = tmp_path / "run"
    nodes, logs = _start_nodes(
        tmp_path,
        run_dir,
        _train_args(shakespeare, run_dir),
        node_env=({"JOIN_TIMEOUT": "3"}, {"JOIN_TIMEOUT": "3"}),
        started=(alone,),
    )
    try:
        code = nodes[0].wait(timeout=120)
    finally:
        _kill_running(nodes)
    text = logs[0].read_text()
    assert code == 2, text[-4000:]
    assert "Traceback" not in text and "frame #" not in text, text[-4000:]
    assert text.strip().splitlines()[-1] == "error: " + error.format(port=_port(nodes[0]))
    assert not run_dir.exists()
    wait_until_none_left(str(run_dir))


def _port(node: subprocess.Popen) -> str:
    return node.args[3]  # python node_launcher.py NODE_RANK PORT ...


@pytest.mark.slow
def test_the_rendezvous_host_waits_for_a_slow_node_to_leave_the_exit_barrier(shakespeare, tmp_path):
    """When training ends, torchrun's agents meet in an exit barrier kept in the store that
    node 0's launcher hosts. Node 1's agent is slow: it pauses 3 s between joining the
    barrier and waiting on it. Node 0's launcher must keep the store until node 1 has left
    (it exited at once, and node 1's agent logged "Error waiting on exit barrier" with a
    traceback: pytorch/pytorch#69520, seen once in six two-node runs under load).

    Node 1 also starts 3 s before the host: it waits for the host's launcher to come up
    (--join-timeout) rather than failing its first connection."""
    run_dir = tmp_path / "run"
    train = _train_args(
        shakespeare,
        run_dir,
        "parallel.tensor=2",
        "train.steps=2",
        "train.warmup_steps=0",
        "train.eval_interval=2",
    )
    nodes, logs = _start_nodes(
        tmp_path,
        run_dir,
        train,
        node_env=({}, {"EXIT_BARRIER_DELAY": "3"}),
        started=(1, 0),
        stagger=3.0,
    )
    try:
        codes = [node.wait(timeout=300) for node in nodes]
    finally:
        _kill_running(nodes)
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], [text[-4000:] for text in texts]
    for text in texts:
        assert "Error waiting on exit barrier" not in text, text[-4000:]
        assert "Traceback" not in text, text[-4000:]
    wait_until_none_left(str(run_dir))


def _run_nodes_to_the_end(
    tmp_path: Path, run_dir: Path, train: list[str], label: str, kills=(), **start
) -> tuple[list[int], list[str]]:
    """Two node launchers of one run, two ranks each; each ``(step, node, rank)`` of
    ``kills`` SIGKILLs that rank once the run has logged that step. Their exit codes and
    logs."""
    env = {"NPROC_PER_NODE": "2"}
    nodes, logs = _start_nodes(tmp_path, run_dir, train, label=label, node_env=(env, env), **start)
    try:
        deadline = time.monotonic() + patient(300)
        for step, node, rank in kills:
            while max(_losses(run_dir), default=0) < step:
                assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline, [
                    log.read_text()[-3000:] for log in logs
                ]
                time.sleep(0.1)
            _worker(nodes[node], rank=rank).send_signal(signal.SIGKILL)
        codes = [node.wait(timeout=patient(600)) for node in nodes]
    finally:
        _kill_running(nodes)
    wait_until_none_left(str(run_dir))
    return codes, [log.read_text() for log in logs]


@pytest.mark.slow
def test_a_restart_budget_restarts_every_node_when_a_rank_of_either_dies(
    shakespeare, tmp_path, uninterrupted_four_ranks
):
    """Two nodes of two ranks each on this host (world 4: tensor-parallel pairs inside a
    node, data parallel across; each node's first rank reads data), ``max_restarts=2``.
    After step 4 (step 3 saved) the data reader of the node that hosts the rendezvous is
    SIGKILLed, after step 7 (step 6 saved) the other node's: each time both nodes restart
    into a fresh rendezvous round, the restarted readers open their data beside what the
    killed attempt left in shared memory, and the run resumes from the newest checkpoint and
    finishes with every step's loss bitwise that of four ranks never interrupted (conftest.py);
    nothing of the run outlives it, and a surviving rank says in one line that a peer ended.
    (Before: the first node to restart joined the round the other had closed, and a restarted
    reader died on mosaicml-streaming's "shared memory registered does not match local
    leader".)"""

    run_dir = tmp_path / "run"
    codes, texts = _run_nodes_to_the_end(
        tmp_path,
        run_dir,
        [*TWO_RANK_RUN, f"data.path={shakespeare}", f"log.run_dir={run_dir}"],
        "killed",
        kills=((4, 0, 0), (7, 1, 2)),
        restarts=(2, 2),
        restart_timeout=120,
    )
    assert codes == [0, 0], [text[-4000:] for text in texts]
    assert "world 4 = TP 2 x PP 1 x DP 2" in texts[0], texts[0][-4000:]
    for text in texts:
        for restart in (1, 2):
            assert f"restart {restart} of 2, resuming from the newest checkpoint" in text, text[
                -4000:
            ]
        assert "RendezvousClosedError" not in text and "Traceback" not in text, text[-4000:]
        assert "Exception raised from" not in text, text[-4000:]
        assert "shared memory" not in text, text[-4000:]
    assert re.search(
        r"error: rank \d: another rank has ended, breaking a collective \(.*\); its output "
        r"says why",
        texts[0] + texts[1],
    ), [text[-4000:] for text in texts]
    for step in (3, 6):
        assert f"resumed from {run_dir / 'checkpoints'}/step_{step:08d}" in texts[0], texts[0][
            -4000:
        ]
    assert _losses(run_dir) == _losses(uninterrupted_four_ranks.run_dir)
    assert sorted(_losses(run_dir)) == list(range(1, TWO_RANK_STEPS + 1))


@pytest.mark.slow
def test_a_restart_that_the_other_node_never_joins_ends_in_one_line(shakespeare, tmp_path):
    """Node 0 restarts after its worker is killed, but node 1 has no restart budget (its
    worker fails too, and it exits): node 0 waits its ``restart_timeout`` for node 1, then
    exits with its failed workers' code and one line, not torch's ten minutes."""
    run_dir = tmp_path / "run"
    nodes, logs = _start_nodes(
        tmp_path,
        run_dir,
        [*TWO_RANK_RUN, f"data.path={shakespeare}", f"log.run_dir={run_dir}"],
        restarts=(1, 0),
        restart_timeout=5,
    )
    try:
        _wait_for_step(nodes[0], run_dir, logs[0], 2)
        _worker(nodes[0], rank=0).send_signal(signal.SIGKILL)
        started = time.monotonic()
        code = nodes[0].wait(timeout=300)
        waited = time.monotonic() - started
        nodes[1].wait(timeout=120)
    finally:
        _kill_running(nodes)
    text = logs[0].read_text()
    assert code == 128 + signal.SIGKILL, text[-4000:]
    assert waited < 120, text[-4000:]
    assert re.search(
        r"t2train launch: restart 1: not every node restarted within 5 s "
        rf"\(RendezvousTimeoutError\); exit code {code}\n",
        text,
    ), text[-4000:]
    assert "Traceback" not in text.split("restart 1 of 1")[-1], text[-4000:]
    wait_until_none_left(str(run_dir))


@pytest.mark.slow
def test_a_stop_during_a_restart_ends_it_on_every_node(shakespeare, tmp_path):
    """Two nodes with a restart budget; after step 1 node 0's rank is killed. Node 0 then
    waits in the restart's rendezvous, and node 1 pauses before its restart (a slow node):
    SIGUSR1 to both launchers (as SLURM signals every node) ends the restart on both, in
    either phase: no worker starts again, and both exit with the stop's code (75: run again
    to resume) within seconds, in one line each. (A stop that reached no worker was lost:
    both nodes restarted and trained on, and SLURM killed them after its grace period.)"""
    run_dir = tmp_path / "run"
    nodes, logs = _start_nodes(
        tmp_path,
        run_dir,
        [*TWO_RANK_RUN, f"data.path={shakespeare}", f"log.run_dir={run_dir}"],
        restarts=(1, 1),
        restart_timeout=120,
        node_env=({}, {"RESTART_DELAY": "90"}),
    )
    try:
        _wait_for_step(nodes[0], run_dir, logs[0], 1)
        _worker(nodes[0], rank=0).send_signal(signal.SIGKILL)
        deadline = time.monotonic() + patient(120)
        while not (
            "restart 1 of 1" in logs[0].read_text()
            and "pausing before its restart" in logs[1].read_text()
        ):
            assert all(node.poll() is None for node in nodes) and time.monotonic() < deadline, [
                log.read_text()[-3000:] for log in logs
            ]
            time.sleep(0.1)
        time.sleep(1)  # node 0's agent waits in the rendezvous by now
        for node in nodes:
            node.send_signal(signal.SIGUSR1)
        stopped = time.monotonic()
        codes = [node.wait(timeout=60) for node in nodes]
        took = time.monotonic() - stopped
    finally:
        _kill_running(nodes)
    texts = [log.read_text() for log in logs]
    assert codes == [REQUEUE_EXIT_CODE] * 2, [text[-4000:] for text in texts]
    for text in texts:
        assert (
            text.count("stopped by SIGUSR1") == 1
            and (
                "t2train launch: stopped by SIGUSR1 during restart 1, before any worker could "
                f"save; exit code {REQUEUE_EXIT_CODE} (run the same command again to resume from "
                "the newest checkpoint)\n"
            )
            in text
        ), text[-4000:]
        assert "Traceback" not in text.split("restart 1 of 1")[-1], text[-4000:]
        assert "resumed from" not in text, text[-4000:]  # no worker started again
    print(f"both nodes stopped {took:.1f} s after the signal")
    assert took < 30
    wait_until_none_left(str(run_dir))


def killed_by_sigterm(pid: int) -> bool:
    """Whether SIGTERM would end process ``pid``: neither ignored nor handled by it, and
    unblocked in one of its threads (a signal blocked in every thread stays pending)."""
    try:
        masks = signal_masks(pid)
        if has(masks["SigIgn"] | masks["SigCgt"], signal.SIGTERM):
            return False
        return any(
            not has(signal_masks(pid, int(task.name))["SigBlk"], signal.SIGTERM)
            for task in Path(f"/proc/{pid}/task").iterdir()
        )
    except FileNotFoundError:  # it ended meanwhile (a writer of a save that finished)
        return False


def _tree(root: int) -> dict[psutil.Process, str]:
    """The processes under ``root`` (itself included) and their command lines."""
    tree = {}
    for process in [psutil.Process(root), *psutil.Process(root).children(recursive=True)]:
        try:
            tree[process] = " ".join(process.cmdline())
        except psutil.NoSuchProcess:
            continue
    return tree


@pytest.mark.slow
def test_sigterm_to_every_process_of_the_tree_saves_the_current_step(shakespeare, tmp_path):
    """The launcher, the trainer, multiprocessing's resource tracker and the processes of the
    asynchronous checkpoint writer (its results' server, started by the step-2 save) all get
    SIGTERM at once: none of them dies of it, and the checkpoint of the step the trainer was
    in is published (exit code 75)."""
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    proc = _start(
        shakespeare,
        run_dir,
        log,
        1,
        "train.steps=400",
        "train.eval_interval=400",
        "checkpoint.interval=2",
        "checkpoint.async_save=true",
        "log.diagnostics_interval=0",
    )
    latest, published = run_dir / "checkpoints" / "latest", {}
    try:
        _wait_for_step(proc, run_dir, log, 3)
        tree = _tree(proc.pid)
        assert any("resource_tracker" in c for c in tree.values()), tree
        assert any("spawn_main" in c for c in tree.values()), tree  # the results' server
        assert [c for p, c in tree.items() if killed_by_sigterm(p.pid)] == []
        signalled = time.monotonic()
        for process in tree:
            try:
                process.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        running = max(_logged_steps(run_dir))  # the trainer is past it or in the next step
        while proc.poll() is None:
            assert time.monotonic() < signalled + 120, log.read_text()[-4000:]
            if latest.is_file():
                published.setdefault(latest.read_text().strip(), time.monotonic() - signalled)
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert proc.returncode == REQUEUE_EXIT_CODE, output[-4000:]
    stopped = max(_logged_steps(run_dir))
    assert stopped in (running, running + 1), (running, stopped)
    assert f"step {stopped:>6} | stopping early: received SIGTERM" in output
    assert latest.read_text().strip() == f"step_{stopped:08d}"
    assert "Error" not in output, output[-4000:]
    seconds = published.get(f"step_{stopped:08d}", 0.0)
    print(f"SIGTERM to every process: step {stopped} published {seconds:.1f}s after the signal")
    assert seconds < 30  # SLURM's default KillWait, after which SIGKILL follows


@pytest.mark.parametrize(
    "args, env, cause",
    [
        ([], {}, "--nproc-per-node: not given and there is no GPU to count"),
        (["--nproc-per-node=2"], {"SLURM_JOB_ID": "7"}, "SLURM_STEP_ID is not set"),
        (
            ["--nproc-per-node=3", "parallel.tensor=2"],
            {},
            "parallel.tensor*parallel.pipeline=2: must divide the world size 3",
        ),
        (
            ["--nproc-per-node=2", "train.exit_signals=SIGNOPE"],
            {},
            "train.exit_signals='SIGNOPE': 'SIGNOPE' is not a catchable signal name",
        ),
    ],
)
def test_bad_launches_fail_with_one_line(shakespeare, tmp_path, args, env, cause):
    if not args and torch.cuda.is_available():
        pytest.skip("with CUDA the process count defaults to the devices")
    proc = subprocess.run(
        _launch_cmd(*args, *_train_args(shakespeare, tmp_path / "run")),
        capture_output=True,
        text=True,
        env=dict(_env(), **env),
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {cause}"), proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_rendezvous_port_in_use_is_refused():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LaunchError, match=f"--port={port}: port {port} is already in use"):
            plan_standalone(2, port)


def test_processes_per_node_comes_from_the_option_or_the_gpus():
    assert processes_per_node(2, None, cuda_devices=0) == 2  # CPU: processes per node
    assert processes_per_node(None, 4, cuda_devices=4) == 4
    assert processes_per_node(None, None, cuda_devices=2) == 2
    with pytest.raises(LaunchError, match="--nproc-per-node: not given and there is no GPU"):
        processes_per_node(None, None, cuda_devices=0)
    with pytest.raises(LaunchError, match="--nproc-per-node=3: more processes than the 2 CUDA"):
        processes_per_node(3, None, cuda_devices=2)


@pytest.mark.gpu
def test_more_processes_than_cuda_devices_is_refused(shakespeare, tmp_path):
    too_many = torch.cuda.device_count() + 1
    proc = subprocess.run(
        _launch_cmd(f"--nproc-per-node={too_many}", *_train_args(shakespeare, tmp_path / "run")),
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --nproc-per-node={too_many}: more processes than the "
        f"{torch.cuda.device_count()} CUDA device(s) visible on this node"
    )


def test_the_node_exit_code_prefers_a_completed_requeue_save():
    assert exit_code([REQUEUE_EXIT_CODE, -15]) == REQUEUE_EXIT_CODE  # peer killed on exit
    assert exit_code([-15, 74]) == 74  # rank 0 killed by torchrun while exiting with 74 too
    assert exit_code([1, 0]) == 1
    assert exit_code([-9]) == 128 + 9
