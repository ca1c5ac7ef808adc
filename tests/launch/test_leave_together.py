"""The nodes of a run that succeeded leave together: the rendezvous host keeps its c10d store
until every other node has said that its agent is done with it (a real TCPStore, in one
process; the two-node run with a slow node is in test_launcher.py)."""

from __future__ import annotations

import threading
import time

from t2train.launch.plan import LaunchPlan, plan_standalone
from t2train.launch.rendezvous import leave_together
from t2train.launch.torchrun import _rendezvous_store


def _plan(node_rank: int, port: int, nnodes: int = 3) -> LaunchPlan:
    return LaunchPlan(
        mode="slurm",
        nodes=tuple(f"node{n}" for n in range(nnodes)),
        node_rank=node_rank,
        nproc_per_node=1,
        rdzv_host="127.0.0.1",
        rdzv_port=port,
        rdzv_id="job",
    )


def test_the_host_returns_once_every_other_node_has_left():
    port = plan_standalone(1, None).rdzv_port
    store = _rendezvous_store(_plan(0, port))  # as node 0's launcher serves it
    host = threading.Thread(target=leave_together, args=(_plan(0, port), 2, store, 60.0))
    host.start()
    leave_together(_plan(1, port), 2, None)
    time.sleep(0.5)
    assert host.is_alive()  # node 2 has not left
    leave_together(_plan(2, port), 1, None)  # another attempt's leave does not count
    time.sleep(0.5)
    assert host.is_alive()
    leave_together(_plan(2, port), 2, None)
    host.join(timeout=10)
    assert not host.is_alive()


def test_a_node_that_never_leaves_holds_the_host_for_the_timeout_only(capsys):
    port = plan_standalone(1, None).rdzv_port
    store = _rendezvous_store(_plan(0, port, nnodes=2))
    started = time.monotonic()
    leave_together(_plan(0, port, nnodes=2), 0, store, timeout=1.0)
    assert 1.0 <= time.monotonic() - started < 10
    assert capsys.readouterr().err == (
        "t2train launch: not every node left within 1 s of the run's end; "
        "closing the rendezvous store\n"
    )


def test_one_node_has_nobody_to_wait_for():
    started = time.monotonic()
    leave_together(_plan(0, 1, nnodes=1), 0, None)
    assert time.monotonic() - started < 1
