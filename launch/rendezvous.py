"""torchrun's c10d rendezvous, for nodes that may outlive the node that hosts it.

The rendezvous store lives in node 0's launcher (``is_host``). When node 0's workers end first
(they saved and stopped with the requeue code a moment before the other nodes' workers, or
one of them failed), its launcher exits and the store goes with it, while every other node's
agent still asks it, once per monitor interval, whether new nodes wait to join
(``num_nodes_waiting``). That question then raised ``RendezvousConnectionError`` out of
torchrun: the node's launcher printed a long traceback and exited 1 while its own workers were
still finishing, and the job script saw 1 instead of the workers' code.

With the host gone no node can join, so ``HostMayEndFirst`` answers "none waiting" and the
agent goes on waiting for its workers; the launcher then exits with their code. It is
registered as a rendezvous backend of its own (torch's documented extension point), which
``t2train launch`` names instead of ``c10d``.

After a run that succeeded, the agents meet in an exit barrier in the same store: each adds
itself, then waits for the last one's key. The host's agent can see that key and its launcher
exit while another agent is between the two calls, whose wait then fails on the gone store
("Error waiting on exit barrier", a traceback; pytorch/pytorch#69520). So the nodes leave
together (``leave_together``): the host keeps its store until every other node's launcher has
said that its agent is done.
"""

from __future__ import annotations

import socket
import sys
import time
from datetime import timedelta
from typing import Optional

BACKEND = "t2train-c10d"
# How long the host waits for the other nodes to leave a run that succeeded; they only have to
# finish the exit barrier, so this bounds a node that died after training.
LEAVE_TIMEOUT = 30.0


class HostMayEndFirst:
    """The c10d rendezvous handler, except that once its store is unreachable no node waits,
    and nothing more is sent to it (each try would log a warning with a C++ stack)."""

    def __init__(self, handler):
        self._handler = handler
        self._host_gone = False

    def __getattr__(self, name: str):
        return getattr(self._handler, name)

    def get_backend(self) -> str:
        return BACKEND

    def num_nodes_waiting(self) -> int:
        from torch.distributed.elastic.rendezvous import RendezvousConnectionError

        if self._host_gone:
            return 0
        try:
            return self._handler.num_nodes_waiting()
        except RendezvousConnectionError:  # the host node has ended: nobody can join
            self._host_gone = True
            stop_heartbeats = getattr(self._handler, "_stop_heartbeats", None)
            if stop_heartbeats is not None:  # torch's keep-alive would fail every 5 s
                stop_heartbeats()
            return 0

    def shutdown(self) -> bool:
        """Close the rendezvous, unless its store has gone with the host."""
        return False if self._host_gone else self._handler.shutdown()


def _create_handler(params):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    backend, store = create_backend(params)
    return HostMayEndFirst(create_handler(store, backend, params))


def register() -> None:
    """Make ``BACKEND`` available to torchrun in this process (registering again is a no-op)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)


def wait_for_host(plan, timeout: float) -> Optional[OSError]:
    """On a node other than the host: wait up to ``timeout`` seconds (``--join-timeout``) until
    the host's launcher accepts connections; returns the last connection error if it never
    did. torchrun's agent would try for its own fixed 60 s (whatever ``--join-timeout``
    says), and log each failed try with a C++ stack."""
    if plan.is_rdzv_host:
        return None
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((plan.rdzv_host, plan.rdzv_port), timeout=5).close()
            return None
        except OSError as err:
            if time.monotonic() >= deadline:
                return err
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def _left_key(rdzv_id: str, attempt: int, node_rank: int) -> str:
    return f"t2train/left/{rdzv_id}/{attempt}/{node_rank}"


def leave_together(plan, attempt: int, store, timeout: float = LEAVE_TIMEOUT) -> None:
    """Call once the node's agent has returned from a successful ``attempt``.

    The host (which passes the ``store`` it serves) waits up to ``timeout`` seconds for each
    other node to say it has left; another node says so, and never waits: if the host is
    already gone, nothing is lost."""
    from torch.distributed import DistError, TCPStore

    if plan.nnodes == 1:
        return
    if plan.is_rdzv_host:
        others = [_left_key(plan.rdzv_id, attempt, rank) for rank in range(1, plan.nnodes)]
        try:
            store.wait(others, timedelta(seconds=timeout))
        except DistError:  # timed out: a node died after the barrier
            print(
                f"t2train launch: not every node left within {timeout:.0f} s of the run's "
                "end; closing the rendezvous store",
                file=sys.stderr,
                flush=True,
            )
        return
    try:
        client = TCPStore(
            plan.rdzv_host, plan.rdzv_port, is_master=False, timeout=timedelta(seconds=10)
        )
        client.set(_left_key(plan.rdzv_id, attempt, plan.node_rank), "")
    except DistError:  # the host has ended already
        pass
