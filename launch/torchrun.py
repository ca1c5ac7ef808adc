"""Run ``t2train train`` under torchrun's elastic agent, in this process, from a LaunchPlan.

The agent runs in-process so that the workers' exit codes reach the job script: torchrun's
own ``main`` turns any worker failure into exit code 1, which would hide that the trainer
stopped early on purpose (``REQUEUE_EXIT_CODE``) and wants to be requeued.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
from typing import Iterable, Optional

from t2train.launch import rendezvous
from t2train.launch.plan import JOIN_TIMEOUT, RESTART_TIMEOUT, LaunchError, LaunchPlan
from t2train.processes import LAUNCHER_PID, become_subreaper, end_descendants
from t2train.signals import REQUEUE_EXIT_CODE, block

TORCH_HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def torchrun_argv(
    plan: LaunchPlan,
    train_argv: list[str],
    agent_signals: Iterable[str] = TORCH_HANDLED_SIGNALS,
    attempt: int = 0,
    join_timeout: float | None = None,
) -> list[str]:
    """torchrun's arguments for ``attempt`` (0: the first start, n: the n-th restart).

    Each attempt is a rendezvous of its own (``rdzv_id``-restartN), which every node derives
    from its own restart count: a node that restarts first waits in the new one while the
    others still end the old one, which the first node to fail has closed (joining the closed
    round was ``RendezvousClosedError``)."""
    rdzv_id = plan.rdzv_id if attempt == 0 else f"{plan.rdzv_id}-restart{attempt}"
    conf = f"is_host={'true' if plan.is_rdzv_host else 'false'}"
    if join_timeout is not None:
        conf += f",join_timeout={max(1, round(join_timeout))}"
    return [
        f"--nnodes={plan.nnodes}",
        f"--nproc-per-node={plan.nproc_per_node}",
        f"--signals-to-handle={','.join(agent_signals)}",
        f"--rdzv-backend={rendezvous.BACKEND}",
        f"--rdzv-endpoint={plan.rdzv_host}:{plan.rdzv_port}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf={conf}",
        "--max-restarts=0",
        "--module",
        "t2train.cli",
        "train",
        *train_argv,
    ]


def quiet_libtorch_warnings() -> None:
    """libtorch's warnings carry a C++ stack each: when a node ends, every store client of the
    other nodes (agents, workers) printed ~20 lines per failed call. Read when torch is
    imported, so call this first; ``TORCH_CPP_LOG_LEVEL=WARNING`` shows them again."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def exit_code(codes: Iterable[int]) -> int:
    """One exit code for the node from its workers' (negative: killed by that signal).

    A worker exits with REQUEUE_EXIT_CODE only after the checkpoint is published on every
    rank, so that code wins over peers that torchrun killed while they were exiting. Else a
    worker's own exit code wins over a signal: torchrun stops the other workers as soon as one
    has failed, and a peer still exiting with the same code would report that signal.
    """
    codes = list(codes)
    if REQUEUE_EXIT_CODE in codes:
        return REQUEUE_EXIT_CODE
    failed = [code for code in codes if code > 0] or [code for code in codes if code != 0] or [1]
    return failed[0] if failed[0] > 0 else 128 - failed[0]


class StopDuringRestart(BaseException):
    """A stop signal reached the launcher while it restarted its workers, with no worker
    alive to save: the restart ends and the node stops. A BaseException, so that no handler
    of torch's agent on the way out (its rendezvous retries on ``Exception``) takes it."""

    def __init__(self, sig: int):
        super().__init__(signal.Signals(sig).name)
        self.sig = signal.Signals(sig)


class _Stop:
    """The first stop signal this launcher received (None: none), and whether it is
    restarting its workers (from the failure of an attempt until the next succeeds, fails or
    stops), when a stop that no worker receives ends the restart (``StopDuringRestart``)."""

    def __init__(self) -> None:
        self.signal: Optional[signal.Signals] = None
        self.restarting = False


_STOP = _Stop()


def _hand_signals_to_workers(signals: list[signal.Signals]) -> list[str]:
    """Make the stop signals reach every worker, and never end or disturb this agent.

    Blocked in this (main) thread, they are inherited blocked by the workers it starts, which
    poll them at step boundaries (StopGuard), and by the workers' own children. A signal sent
    to this process (``kill PID``, or SLURM's signal to every process of the step) is passed
    on to the workers whichever thread the kernel hands it to: a thread started before the
    block (``import torch`` starts one) runs the handler, else the waiting thread takes it.
    A worker that receives it twice sees it once. torch's agent is told to leave these
    signals alone: its handler would shut the workers down before they can save.

    During a restart no worker may be alive to receive it (the failed attempt's have ended,
    the next attempt's wait in the rendezvous for the other nodes): then the main thread is
    interrupted wherever it waits (``StopDuringRestart``), and the node stops instead of
    restarting.
    """
    import psutil

    def forward(sig: int, _frame=None) -> None:
        workers = 0
        for child in psutil.Process().children():
            try:
                child.send_signal(sig)
                workers += "t2train.cli" in child.cmdline()
            except psutil.Error:  # it ended meanwhile
                pass
        _STOP.signal = _STOP.signal or signal.Signals(sig)
        if _STOP.restarting and not workers:
            if threading.current_thread() is threading.main_thread():
                raise StopDuringRestart(sig)
            _thread.interrupt_main(signal.Signals(sig))  # this handler, in the main thread

    def wait_and_forward() -> None:
        while True:
            forward(signal.sigwait(signals))

    block(signals)
    for sig in signals:
        signal.signal(sig, forward)
    threading.Thread(target=wait_and_forward, daemon=True, name="t2train-signals").start()
    names = {sig.name for sig in signals}
    return [name for name in TORCH_HANDLED_SIGNALS if name not in names]


def run(
    plan: LaunchPlan,
    train_argv: list[str],
    exit_signals: list[signal.Signals],
    max_restarts: int = 0,
    restart_timeout: float = RESTART_TIMEOUT,
    join_timeout: float = JOIN_TIMEOUT,
) -> int:
    """Start the node's workers and wait for them; returns the node's exit code.

    The start waits ``join_timeout`` seconds for every node's launcher to join; a start that
    cannot gather them raises ``LaunchError`` saying where it waited and for which nodes.

    Restarts are this loop's, not torchrun's ``--max-restarts``: torchrun would also restart
    workers that stopped on purpose to be requeued (REQUEUE_EXIT_CODE), and they would then
    train on until the allocation ends without saving. A restart waits ``restart_timeout``
    seconds for every node's launcher to restart too; if one does not (its workers ended
    otherwise, or it is gone), this node ends with its failed workers' code.
    """
    agent_signals = (
        _hand_signals_to_workers(exit_signals) if exit_signals else TORCH_HANDLED_SIGNALS
    )
    quiet_libtorch_warnings()  # the workers' (this process may have imported torch already)
    become_subreaper()  # the orphans of a killed worker become ours, not pid 1's
    os.environ[LAUNCHER_PID] = str(os.getpid())  # workers die with this launcher
    store = _rendezvous_store(plan) if max_restarts or plan.nnodes > 1 else None
    unreachable = rendezvous.wait_for_host(plan, join_timeout)
    if unreachable is not None:
        raise LaunchError(_host_unreachable(plan, unreachable, join_timeout))
    attempt = 0
    try:
        code, workers_failed = _run_once(plan, train_argv, agent_signals, 0, join_timeout)
        for restart in range(1, max_restarts + 1):
            if not workers_failed:
                break
            attempt = restart
            _STOP.restarting = bool(exit_signals)
            if _STOP.signal is not None:  # it came while the failed attempt ended
                raise StopDuringRestart(_STOP.signal)
            _end_leftovers()
            print(
                f"t2train launch: workers failed (exit code {code}); restart {restart} of "
                f"{max_restarts}, resuming from the newest checkpoint",
                flush=True,
            )
            code, workers_failed = _run_once(
                plan,
                [*train_argv, "checkpoint.resume=auto"],
                agent_signals,
                restart,
                restart_timeout,
                code,
            )
            _STOP.restarting = False
        if code == 0:
            rendezvous.leave_together(plan, attempt, store)
    except StopDuringRestart as stop:
        _STOP.restarting = False
        code = REQUEUE_EXIT_CODE
        print(
            f"t2train launch: stopped by {stop.sig.name} during restart {attempt}, before any "
            f"worker could save; exit code {code} (run the same command again to resume from "
            "the newest checkpoint)",
            file=sys.stderr,
            flush=True,
        )
    finally:
        _end_leftovers()
        del store
    return code


def _rendezvous_store(plan: LaunchPlan):
    """On the rendezvous host, the c10d store's server, kept for every attempt of the run and
    until the other nodes have left it.

    Each attempt's torchrun agent opens the store on the same port in this process, which
    shares this server (``multi_tenant``) instead of starting its own: a server that ended
    with an attempt would drop the other nodes, which may already wait in the next one, or
    still finish the attempt's exit barrier."""
    if not plan.is_rdzv_host:
        return None
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore(
        plan.rdzv_host,
        plan.rdzv_port,
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )


def _end_leftovers() -> None:
    """Kill what the workers left running (helpers of a killed worker), sparing this
    launcher's own resource tracker."""
    from multiprocessing import resource_tracker

    own_tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    ended = end_descendants(spare=[own_tracker] if own_tracker else [])
    if ended:
        print(
            f"t2train launch: ended {len(ended)} process(es) the workers left running: "
            + "; ".join(command[:80] for command in ended),
            file=sys.stderr,
            flush=True,
        )


def _expected(plan: LaunchPlan) -> str:
    return (
        f"{plan.nnodes} nodes expected ({', '.join(plan.nodes)}), one `t2train launch` "
        f"on each; this is node {plan.node_rank}"
    )


def _host_unreachable(plan: LaunchPlan, err: OSError, join_timeout: float) -> str:
    """The host's launcher never answered within ``--join-timeout``, for one error line."""
    return (
        f"node 0 ({plan.nodes[0]}), which hosts the rendezvous at {plan.rdzv_host}:"
        f"{plan.rdzv_port}, could not be reached within {join_timeout:.0f} s (--join-timeout; "
        f"{type(err).__name__}: {err.strerror or err}): {_expected(plan)}"
    )


def _not_gathered(plan: LaunchPlan, err: Exception, join_timeout: float | None) -> str:
    """Why the first rendezvous did not gather every node, for one error line."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    where = f"the rendezvous at {plan.rdzv_host}:{plan.rdzv_port}"
    expected = _expected(plan)
    if isinstance(err, RendezvousTimeoutError):
        why = f"not every node joined {where} within {join_timeout:.0f} s (--join-timeout)"
    elif isinstance(err, RendezvousConnectionError):
        why = f"node 0 ({plan.nodes[0]}), which hosts {where}, could not be reached"
    else:
        why = f"{where} failed ({type(err).__name__}: {err})"
    return f"{why}: {expected}"


def _how_it_ended(exitcode: int) -> str:
    return (
        f"exited with code {exitcode}"
        if exitcode >= 0
        else f"was killed by {signal.Signals(-exitcode).name}"
    )


def _run_once(
    plan: LaunchPlan,
    train_argv: list[str],
    agent_signals: Iterable[str],
    attempt: int = 0,
    join_timeout: float | None = None,
    failed_code: int = 1,
) -> tuple[int, bool]:
    """(exit code, whether workers failed): not for success, a requeue stop, or a signal to
    this launcher. A restart (``attempt`` > 0) that does not assemble every node ends with
    ``failed_code``, the failed workers' code of the attempt before."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    rendezvous.register()
    try:
        torchrun(parse_args(torchrun_argv(plan, train_argv, agent_signals, attempt, join_timeout)))
    except RendezvousError as err:
        if not attempt:
            raise LaunchError(_not_gathered(plan, err, join_timeout)) from None
        print(
            f"t2train launch: restart {attempt}: not every node restarted within "
            f"{join_timeout:.0f} s ({type(err).__name__}); exit code {failed_code}",
            file=sys.stderr,
            flush=True,
        )
        return failed_code, False
    except ChildFailedError as err:
        code = exit_code(failure.exitcode for failure in err.failures.values())
        if code == REQUEUE_EXIT_CODE:
            print(
                f"t2train launch: training saved a checkpoint and stopped early; exit code "
                f"{code} (run the same command again to resume)",
                flush=True,
            )
            return code, False
        failed = "; ".join(
            f"rank {rank} {_how_it_ended(failure.exitcode)}"
            for rank, failure in sorted(err.failures.items())
        )
        print(
            f"t2train launch: workers failed ({failed}); exit code {code}",
            file=sys.stderr,
            flush=True,
        )
        return code, True
    except SignalException as err:
        print(f"t2train launch: stopped by {err.sigval.name}", file=sys.stderr, flush=True)
        return 128 + err.sigval, False
    return 0, False
