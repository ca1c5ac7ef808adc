"""Process-group setup: torch.distributed from the launcher's environment, then Megatron's
tensor/pipeline/data-parallel groups, then seeds."""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from t2train.compat import megatron_cpu
from t2train.ports import free_port


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_size: int
    pp_size: int
    dp_size: int

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_minutes: float = 10.0) -> None:
    """Join the process group torchrun (or SLURM via t2train.launch) described in the env.

    A plain ``python`` run without those variables becomes a world of one.
    """
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if os.environ["WORLD_SIZE"] != "1":
            raise RuntimeError(
                "WORLD_SIZE > 1 but MASTER_PORT is unset: launch with torchrun or `t2train launch`"
            )
        os.environ["MASTER_PORT"] = str(free_port("127.0.0.1"))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = "nccl"
    else:
        megatron_cpu.apply()
        backend = "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))


def current_device() -> torch.device:
    """This rank's device: its CUDA device, or the CPU without one (tensors for collectives)."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def init_model_parallel(tensor: int, pipeline: int, virtual_pipeline: int) -> Topology:
    from megatron.core import parallel_state as ps  # noqa: PLC0415 - megatron-core: not for the CLI's is_rank_zero

    if ps.model_parallel_is_initialized() and (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_virtual_pipeline_model_parallel_world_size() or 1,
    ) != (tensor, pipeline, virtual_pipeline):
        ps.destroy_model_parallel()  # an earlier run in this process had another layout
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tensor,
            pipeline_model_parallel_size=pipeline,
            virtual_pipeline_model_parallel_size=virtual_pipeline if virtual_pipeline > 1 else None,
        )
    return Topology(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_size=ps.get_data_parallel_world_size(),
    )


@contextlib.contextmanager
def environment_kept() -> Iterator[None]:
    """``os.environ`` as it was on entry, once the block ends.

    ``init_distributed`` fills in RANK, MASTER_ADDR, MASTER_PORT, ... for its world of one;
    left set, a ``t2train train`` started from this process (a notebook's ``!t2train``, a
    subprocess) would take them as its launcher's and fail binding this process's port
    (EADDRINUSE). The process group keeps its store: it needs them no longer.
    """
    before = dict(os.environ)
    try:
        yield
    finally:
        for name in set(os.environ) - set(before):
            del os.environ[name]
        for name, value in before.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


def one_process_world() -> bool:
    """torch.distributed and Megatron's groups for this process alone (TP = PP = DP = 1),
    seeded, the environment left as it was (``environment_kept``); False if the process
    is one rank of a larger world (started by torchrun)."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 - megatron-core: not for the CLI's is_rank_zero

    with environment_kept():
        init_distributed()
    if dist.get_world_size() != 1 or (
        ps.model_parallel_is_initialized()
        and ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
        != 1
    ):
        return False
    set_seed(0, init_model_parallel(1, 1, 1))
    return True


def set_seed(seed: int, topology: Topology) -> None:
    """Megatron's seeding: one stream per pipeline stage, the TP-aware CUDA RNG tracker.

    With CPU initialisation every tensor-parallel rank builds the full master weight from the
    same stream and keeps its shard, so TP changes no initial value.
    """
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: PLC0415 - megatron-core: not for the CLI's is_rank_zero

    stage_seed = seed + 100 * topology.pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)


def destroy() -> None:
    from megatron.core import parallel_state as ps  # noqa: PLC0415 - megatron-core: not for the CLI's is_rank_zero

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
