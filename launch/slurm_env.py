"""What a SLURM job step tells the launcher on each node, read from the step's environment.

The launcher runs as one task per node (``srun --ntasks-per-node=1``), so the step's node
list, node count, task count and this node's id describe the whole job. Host lists are
expanded by ``scontrol show hostnames``, SLURM's own parser, rather than by a copy of it.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Mapping, Optional

from t2train.errors import UserInputError

# Set by srun in every task of a job step; a batch script alone lacks the SLURM_STEP_* ones.
REQUIRED = (
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_NUM_NODES",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NODEID",
    "SLURMD_NODENAME",
)


class SlurmEnvError(UserInputError):
    """The SLURM environment is missing a variable or contradicts itself."""


@dataclass(frozen=True)
class SlurmStep:
    job_id: str
    nodes: tuple[str, ...]  # the step's nodes in SLURM's order; node rank i runs on nodes[i]
    node_rank: int
    gpus_on_node: Optional[int]  # SLURM_GPUS_ON_NODE; None when no GPUs were requested
    restart_count: int  # SLURM_RESTART_COUNT: how often the job was requeued


def in_slurm_job(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID"))


def _int(env: Mapping[str, str], name: str, minimum: int) -> int:
    raw = env[name]
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise SlurmEnvError(f"{name}={raw!r}: expected an integer >= {minimum}")
    return value


def _scontrol(*args: str, about: str) -> str:
    try:
        proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SlurmEnvError(
            f"{about}: scontrol is not on PATH (needed to read the SLURM allocation)"
        ) from None
    if proc.returncode != 0:
        cause = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise SlurmEnvError(f"{about}: `scontrol {' '.join(args)}` failed: {cause}")
    return proc.stdout


def expand_nodelist(nodelist: str) -> tuple[str, ...]:
    """``gpu-[01-03,07]`` -> ``('gpu-01', 'gpu-02', 'gpu-03', 'gpu-07')``."""
    return tuple(
        _scontrol("show", "hostnames", nodelist, about=f"SLURM_STEP_NODELIST={nodelist!r}").split()
    )


def node_address(node: str) -> str:
    """The address SLURM itself reaches ``node`` at (its NodeAddr, usually the host name)."""
    fields = _scontrol("show", "node", "--oneliner", node, about=f"node {node!r}").split()
    for item in fields:
        key, _, value = item.partition("=")
        if key == "NodeAddr" and value:
            return value
    raise SlurmEnvError(f"node {node!r}: `scontrol show node` reports no NodeAddr")


def read_step(env: Mapping[str, str]) -> SlurmStep:
    """Parse and cross-check the step variables; errors name the variable at fault."""
    missing = [name for name in REQUIRED if not env.get(name)]
    if missing:
        raise SlurmEnvError(
            f"{missing[0]} is not set: run the launcher as one task per node "
            "of a job step (`srun --ntasks-per-node=1 t2train launch ...` in "
            "an sbatch script or salloc), or pass --standalone"
        )
    job_id = _int(env, "SLURM_JOB_ID", 1)
    num_nodes = _int(env, "SLURM_STEP_NUM_NODES", 1)
    num_tasks = _int(env, "SLURM_STEP_NUM_TASKS", 1)
    node_rank = _int(env, "SLURM_NODEID", 0)
    if num_tasks != num_nodes:
        raise SlurmEnvError(
            f"SLURM_STEP_NUM_TASKS={num_tasks}: expected one launcher per node "
            f"(SLURM_STEP_NUM_NODES={num_nodes}); start it with "
            "`srun --ntasks-per-node=1`"
        )
    nodes = expand_nodelist(env["SLURM_STEP_NODELIST"])
    if len(nodes) != num_nodes:
        raise SlurmEnvError(
            f"SLURM_STEP_NODELIST={env['SLURM_STEP_NODELIST']!r}: names "
            f"{len(nodes)} nodes, but SLURM_STEP_NUM_NODES={num_nodes}"
        )
    if node_rank >= num_nodes:
        raise SlurmEnvError(
            f"SLURM_NODEID={node_rank}: expected < SLURM_STEP_NUM_NODES={num_nodes}"
        )
    if nodes[node_rank] != env["SLURMD_NODENAME"]:
        raise SlurmEnvError(
            f"SLURMD_NODENAME={env['SLURMD_NODENAME']!r}: expected "
            f"{nodes[node_rank]!r}, node {node_rank} of SLURM_STEP_NODELIST="
            f"{env['SLURM_STEP_NODELIST']!r}"
        )
    gpus = _int(env, "SLURM_GPUS_ON_NODE", 0) if env.get("SLURM_GPUS_ON_NODE") else None
    restarts = _int(env, "SLURM_RESTART_COUNT", 0) if env.get("SLURM_RESTART_COUNT") else 0
    return SlurmStep(
        job_id=str(job_id),
        nodes=nodes,
        node_rank=node_rank,
        gpus_on_node=gpus,
        restart_count=restarts,
    )
