"""``t2train train`` whose weight gradients turn NaN from one step on (fault injection).

Usage: ``nan_from_step.py STEP -- <t2train train arguments>``: from the STEP-th training
step of this process, a hook makes one MLP weight's gradient NaN on every backward.
"""

from __future__ import annotations

import math
import sys

import torch

from t2train import cli
from t2train.engine.megatron import MegatronEngine


def main() -> int:
    first_bad, separator, *train_args = sys.argv[1:]
    assert separator == "--", "usage: nan_from_step.py STEP -- ARGS"
    train_step = MegatronEngine.train_step
    calls = []

    def poisoned_train_step(engine, micro_batches):
        calls.append(1)
        if len(calls) == int(first_bad):
            weight = engine.model[0].module.decoder.layers[0].mlp.linear_fc1.weight
            weight.register_hook(lambda grad: torch.full_like(grad, math.nan))
        return train_step(engine, micro_batches)

    MegatronEngine.train_step = poisoned_train_step
    return cli.main(["train", *train_args])


if __name__ == "__main__":
    sys.exit(main())
