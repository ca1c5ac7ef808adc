"""``t2train train`` with a fault injected from one training step on.

Usage: ``faulty_train.py FAULT STEP -- <t2train train arguments>``, FAULT one of
``nan_gradient`` (from the STEP-th step of this process, one MLP weight's gradient is NaN
on every backward) or ``hang`` (the highest rank freezes, SIGSTOP, at its STEP-th step).
"""

from __future__ import annotations

import math
import os
import signal
import sys

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


FAULTS = {"nan_gradient": _nan_gradient, "hang": _hang}


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
