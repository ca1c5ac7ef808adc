"""One node of a two-node ``t2train launch`` on this host, for tests without SLURM: the
launcher's torchrun run with the plan SLURM would give node ``NODE_RANK`` (world = 2 nodes x
1 process, c10d rendezvous on 127.0.0.1:PORT hosted by node 0), restarting its workers up to
MAX_RESTARTS times (each restart waiting RESTART_TIMEOUT seconds for the other node).
``NPROC_PER_NODE`` in its environment gives each node that many processes (default 1).

    python node_launcher.py NODE_RANK PORT MAX_RESTARTS RESTART_TIMEOUT [t2train train args]

With ``EXIT_BARRIER_DELAY`` (seconds) in its environment, the node's torchrun agent pauses that
long between joining the agents' exit barrier and waiting on it: a slow node. ``JOIN_TIMEOUT``
(seconds) is ``--join-timeout``. With ``RESTART_DELAY`` (seconds), the node pauses that long
before its first restart, having printed ``pausing before its restart``: a slow node. A
launch error ends it as it ends ``t2train launch``: one ``error:`` line and its exit code.
"""

import os
import sys
import time

from t2train.launch import torchrun

torchrun.quiet_libtorch_warnings()  # before torch is imported, as `t2train launch` does

from t2train.config.schema import TrainConfig  # noqa: E402 (imports torch)
from t2train.errors import UserInputError  # noqa: E402
from t2train.launch.plan import JOIN_TIMEOUT, LaunchPlan  # noqa: E402
from t2train.signals import parse_signals  # noqa: E402

EXIT_BARRIER_DELAY = "EXIT_BARRIER_DELAY"
RESTART_DELAY = "RESTART_DELAY"


def _delay_exit_barrier(seconds: float) -> None:
    from torch.distributed.elastic.utils import store

    join = store._barrier_nonblocking

    def join_then_pause(*args, **kwargs):
        last_member_key = join(*args, **kwargs)
        time.sleep(seconds)
        return last_member_key

    store._barrier_nonblocking = join_then_pause


def _delay_restart(seconds: float) -> None:
    """Pause before the first restart (the launcher ends what the workers left first)."""
    end_leftovers, calls = torchrun._end_leftovers, []

    def pause_then_end_leftovers() -> None:
        calls.append(1)
        if len(calls) == 1:
            print("pausing before its restart", flush=True)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:  # short sleeps: a signal's handler runs
                time.sleep(0.05)
        end_leftovers()

    torchrun._end_leftovers = pause_then_end_leftovers


if __name__ == "__main__":
    if RESTART_DELAY in os.environ:
        _delay_restart(float(os.environ.pop(RESTART_DELAY)))
    if EXIT_BARRIER_DELAY in os.environ:
        _delay_exit_barrier(float(os.environ.pop(EXIT_BARRIER_DELAY)))
    node_rank, port, max_restarts, restart_timeout, *train_argv = sys.argv[1:]
    plan = LaunchPlan(
        mode="slurm",
        nodes=("node0", "node1"),
        node_rank=int(node_rank),
        nproc_per_node=int(os.environ.get("NPROC_PER_NODE", "1")),
        rdzv_host="127.0.0.1",
        rdzv_port=int(port),
        rdzv_id="two-nodes",
    )
    try:
        code = torchrun.run(
            plan,
            train_argv,
            parse_signals(TrainConfig().exit_signals),
            int(max_restarts),
            float(restart_timeout),
            float(os.environ.get("JOIN_TIMEOUT", JOIN_TIMEOUT)),
        )
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        code = err.exit_code
    sys.exit(code)
