"""The resolved topology of a launch: nodes, processes per node, and the rendezvous point.

One machine (standalone) or one node of a SLURM step; both end in the same ``LaunchPlan``,
which is printed before anything starts and turned into torchrun's arguments.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from typing import Optional

from t2train.errors import UserInputError
from t2train.launch.slurm_env import SlurmStep, node_address
from t2train.ports import free_port

# SLURM jobs derive their rendezvous port from the job id (every node must agree on it
# without talking first); below Linux's ephemeral range so clients rarely hold it.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000
# How long the first rendezvous waits for every node's launcher (--join-timeout; torchrun's).
JOIN_TIMEOUT = 600.0
# How long a restart waits for every node's launcher to restart too (--restart-timeout).
RESTART_TIMEOUT = 180.0


class LaunchError(UserInputError):
    """The requested launch cannot run here (devices, ports)."""


@dataclass(frozen=True)
class LaunchPlan:
    mode: str  # "standalone" or "slurm"
    nodes: tuple[str, ...]
    node_rank: int
    nproc_per_node: int
    rdzv_host: str
    rdzv_port: int
    rdzv_id: str
    restart_count: int = 0

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def is_rdzv_host(self) -> bool:
        """Node 0 serves the c10d store; the others only connect to it."""
        return self.node_rank == 0

    def describe(self) -> str:
        job = (
            f"SLURM job {self.rdzv_id} (restart {self.restart_count})"
            if self.mode == "slurm"
            else "standalone"
        )
        return (
            f"t2train launch: {job} | {self.nnodes} node(s) {','.join(self.nodes)} | "
            f"node rank {self.node_rank} on {self.nodes[self.node_rank]} | "
            f"{self.nproc_per_node} process(es) per node | world size {self.world_size} | "
            f"c10d rendezvous {self.rdzv_host}:{self.rdzv_port}"
        )


def processes_per_node(
    requested: Optional[int], slurm_gpus: Optional[int], cuda_devices: int
) -> int:
    """``--nproc-per-node``, else the node's allocated GPUs, else its CUDA devices.

    On CUDA, more processes than visible devices is refused (two ranks would share a GPU).
    """
    count = requested or slurm_gpus or cuda_devices
    if not count:
        raise LaunchError(
            "--nproc-per-node: not given and there is no GPU to count "
            "(SLURM_GPUS_ON_NODE unset, no CUDA device); pass the number of "
            "processes per node"
        )
    if count < 1:
        raise LaunchError(f"--nproc-per-node={count}: expected >= 1")
    if cuda_devices and count > cuda_devices:
        raise LaunchError(
            f"--nproc-per-node={count}: more processes than the {cuda_devices} "
            "CUDA device(s) visible on this node"
        )
    return count


def check_port_free(port: int, what: str) -> None:
    """Fail now, with the port named, rather than deep inside torchrun's rendezvous."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            raise LaunchError(
                f"{what}: port {port} is already in use on this host; choose another with --port"
            ) from None


def plan_standalone(nproc_per_node: int, port: Optional[int]) -> LaunchPlan:
    if port is not None:
        check_port_free(port, f"--port={port}")
    return LaunchPlan(
        mode="standalone",
        nodes=(socket.gethostname(),),
        node_rank=0,
        nproc_per_node=nproc_per_node,
        rdzv_host="127.0.0.1",
        rdzv_port=port if port is not None else free_port(),
        rdzv_id="standalone",
    )


def plan_slurm(step: SlurmStep, nproc_per_node: int, port: Optional[int]) -> LaunchPlan:
    """Rendezvous on the step's first node, at a port every node derives the same way."""
    derived = SLURM_PORT_BASE + int(step.job_id) % SLURM_PORT_SPAN
    plan = LaunchPlan(
        mode="slurm",
        nodes=step.nodes,
        node_rank=step.node_rank,
        nproc_per_node=nproc_per_node,
        rdzv_host=node_address(step.nodes[0]),
        rdzv_port=port if port is not None else derived,
        rdzv_id=step.job_id,
        restart_count=step.restart_count,
    )
    if plan.is_rdzv_host:
        what = (
            f"--port={port}"
            if port is not None
            else f"rendezvous port derived from SLURM_JOB_ID={step.job_id}"
        )
        check_port_free(plan.rdzv_port, what)
    return plan
