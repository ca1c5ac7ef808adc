"""Start a model from a weights file of ``t2train ckpt convert`` at other layouts, as a run
with ``checkpoint.init_from`` does, and save it.

``--weights`` is the file (its folder holds the run's ``t2train.yaml`` and
``t2train_weights.json``); ``--layouts`` a ``,``-separated list of ``TPxPP``. For each, the
Megatron engine's objects are built from the file and saved as a step-0 checkpoint under
``--scratch``/<layout>; the result maps each layout to its checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from common import finish, parse_args, use_layout, write_result

from t2train.config.loader import load_config
from t2train.config.schema import CONFIG_FORMAT
from t2train.engine.megatron.checkpoint import save_checkpoint
from t2train.engine.megatron.setup import build_training_objects
from t2train.parallel.init import init_distributed, set_seed
from t2train.train.trainer import weights_to_start_from


def main() -> None:
    args = parse_args([("--weights", Path), ("--scratch", Path), ("--layouts", str)])
    init_distributed()
    record = json.loads((args.weights.parent / "t2train_weights.json").read_text())
    saved = {}
    for layout in args.layouts.split(","):
        tp, pp = (int(n) for n in layout.split("x"))
        set_seed(7, use_layout(tp, pp, 1))  # another initialisation than the file's
        config = load_config(
            config_file=str(args.weights.parent / "t2train.yaml"),
            overrides=[
                f"parallel.tensor={tp}",
                f"parallel.pipeline={pp}",
                f"checkpoint.init_from={args.weights}",
            ],
        )
        vocab = config.model.vocab_size or 128  # the source run's (its data's)
        facts = {"tokenizer_sha256": record["tokenizer_sha256"], "vocab_size": vocab}
        objs = build_training_objects(
            config, config.padded_vocab_size(vocab), weights_to_start_from(config, facts)
        )
        train_state = {"config": asdict(config), "config_format": CONFIG_FORMAT}
        saved[layout] = str(save_checkpoint(args.scratch / layout, 0, objs, train_state))
    write_result(args.out, saved)


if __name__ == "__main__":
    main()
    finish()
