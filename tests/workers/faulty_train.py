"""``t2train train`` with a fault injected from one training step on.

Usage: ``faulty_train.py FAULT STEP -- <t2train train arguments>``, FAULT one of
``nan_gradient`` (from the STEP-th step of this process, one MLP weight's gradient is NaN
on every backward), ``hang`` (the highest rank freezes, SIGSTOP, at its STEP-th step), or a
fault that one rank alone sees in the first checkpoint save after its STEP-th step:
``save_metadata`` (rank 0 cannot write the checkpoint's metadata.json: disk full) or
``save_state`` (Megatron's save fails on the highest rank while it collects its sharded
state). A save fault prints ``fault on rank R at T`` (T: time.time()) to stderr as it fires.
``slow_forward``: the highest rank's model sleeps 0.25 s at the start of each forward pass
(a rank on a slow device).
"""

from __future__ import annotations

import errno
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from t2train import cli
from t2train.engine.megatron import MegatronEngine


def _nan_gradient(engine) -> None:
    weight = engine.model[0].module.decoder.layers[0].mlp.linear_fc1.weight
    weight.register_hook(lambda grad: torch.full_like(grad, math.nan))


def _hang(engine) -> None:
    if dist.get_rank() == dist.get_world_size() - 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen, watchdog thread included


def _fail(error: Exception):
    print(f"fault on rank {dist.get_rank()} at {time.time():.3f}", file=sys.stderr, flush=True)
    raise error


def _save_metadata(engine) -> None:
    from megatron.core.dist_checkpointing import serialization

    if dist.get_rank() == 0:
        serialization.save_config = lambda _config, directory: _fail(
            OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{directory}/metadata.json")
        )


def _save_state(engine) -> None:
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.core import CheckpointingException

    if dist.get_rank() == dist.get_world_size() - 1:
        serialization.save_preprocess = lambda *args: _fail(
            CheckpointingException("cannot collect this rank's sharded state")
        )


SLOW_FORWARD_SECONDS = 0.25


def _slow_forward(engine) -> None:
    if dist.get_rank() == dist.get_world_size() - 1:
        model = engine.model[0].module
        forward = model.forward

        def slowed(*args, **kwargs):
            time.sleep(SLOW_FORWARD_SECONDS)
            return forward(*args, **kwargs)

        model.forward = slowed


FAULTS = {
    "nan_gradient": _nan_gradient,
    "hang": _hang,
    "save_metadata": _save_metadata,
    "save_state": _save_state,
    "slow_forward": _slow_forward,
}


def main() -> int:
    fault, first_bad, separator, *train_args = sys.argv[1:]
    assert separator == "--" and fault in FAULTS, "usage: faulty_train.py FAULT STEP -- ARGS"
    train_step = MegatronEngine.train_step
    calls = []

    def faulty_train_step(engine, micro_batches):
        calls.append(1)
        if len(calls) == int(first_bad):
            FAULTS[fault](engine)
        return train_step(engine, micro_batches)

    MegatronEngine.train_step = faulty_train_step
    return cli.main(["train", *train_args])


if __name__ == "__main__":
    sys.exit(main())
