"""``t2train train --dry-run``: everything a run sets up, then no training.

The same checks and objects as a run's start (``loop.py``): the dataset, the resume target
or the ``checkpoint.init_from`` weights (each verified against its checksums, and its model,
engine or tokenizer against the run's, as the run would), the process groups against the
world size, the engine with its model and optimizer, and one step's micro-batches read
through the loaders. Nothing is written to the run directory and no checkpoint is loaded
(the one that would be is named).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from t2train.config.schema import Config


@dataclass
class DryRun:
    vocab_size: int  # the model's, before padding
    parameters: int  # on rank 0
    world_size: int
    data_parallel: int
    resume_from: Optional[Path]
    skipped: str  # damaged checkpoints resume=auto would skip
    init_from: Optional[Path]  # the weights a fresh start would load (checkpoint.init_from)
    samples: dict  # split -> samples in data.path
    tokens_per_step: int


def dry_run(config: Config) -> DryRun:
    import torch.distributed as dist

    from t2train.checkpoint.compatibility import check_same_model
    from t2train.checkpoint.store import check_engine
    from t2train.checkpoint.train_state import read_train_state
    from t2train.data.index import read_index
    from t2train.engine import build_engine
    from t2train.train.batches import GlobalBatchFeeder
    from t2train.train.data import open_streams
    from t2train.train.trainer import start_ranks, verified, weights_to_start_from

    config = config.with_absolute_paths()  # as train() runs it
    facts, resume_from, dp_size, topology = start_ranks(config)
    skipped, init_from = "", None
    if resume_from is not None:
        resume_from, skipped = verified(config, Path(config.run_dir), resume_from)
        check_engine(resume_from, config.train.engine)
        check_same_model(resume_from, read_train_state(resume_from), config.model)
    elif (weights := weights_to_start_from(config, facts)) is not None:
        weights.check(config)
        init_from = weights.path
    engine = build_engine(config, config.padded_vocab_size(facts["vocab_size"]))
    streams = open_streams(config, topology, dp_size, None)
    try:
        GlobalBatchFeeder(
            streams.train,
            config.micro_batches_per_step(dp_size),
            config.train.micro_batch_size,
            config.model.seq_length,
        ).next_step()
    finally:
        streams.close()
    splits = read_index(config.data.path)["splits"]
    return DryRun(
        facts["vocab_size"],
        engine.num_parameters(),
        dist.get_world_size(),
        dp_size,
        resume_from,
        skipped,
        init_from,
        {split: facts["samples"] for split, facts in splits.items()},
        config.train.global_batch_size * config.model.seq_length,
    )
