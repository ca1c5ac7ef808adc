"""The trainer's data path on real processes (spawn, gloo): a TP=2 x DP=2 world of 4 ranks in
which each replica's tensor-rank-0 process reads and ``GlobalBatchFeeder`` broadcasts its
micro-batches over the replica's model-parallel group.

Checked against one reader that takes a whole global batch per step (DP=1): tensor-parallel
peers get identical batches; the two replicas' samples are disjoint and together are exactly
the single reader's samples of each step, over a whole epoch; a resumed loader continues the
sequence exactly, with the same number of data-parallel readers (2 -> 2) and with another
(2 -> 1, 1 -> 2), which is what a checkpoint's loader state must do.
"""

from __future__ import annotations

import json
import os
import socket
from itertools import islice

import pytest
import torch.multiprocessing as mp

from t2train.data.loader import StreamingWorld, TokenBatches, reader_world
from t2train.data.prepare import read_index

ONE = StreamingWorld(0, 1, 0, 1)
MBS, MICRO, SEQ, SEED = 2, 2, 32, 3
PER_REPLICA = MBS * MICRO  # samples per step and replica
GLOBAL = 2 * PER_REPLICA  # samples per step over both replicas
RESUME_AT = 5  # steps before the saved loader state
AFTER_DP1 = 3  # steps run from the single reader's state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, port, path, out_dir, steps, dp1_state):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="4", LOCAL_RANK=str(rank))
    from megatron.core import parallel_state as ps

    from t2train.parallel.init import destroy, init_distributed
    from t2train.train.batches import GlobalBatchFeeder, is_reader

    init_distributed()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    world = reader_world(is_reader(), ps.get_data_parallel_rank(),
                         ps.get_data_parallel_world_size())

    def run(state, steps):
        """Every rank's tokens per step, the reader's sample ids, its state after RESUME_AT."""
        loader, ids = None, []
        if world is not None:
            loader = TokenBatches(path, "train", MBS, SEQ, world, seed=SEED)
            if state is not None:
                loader.load_state_dict(state)
        feeder = GlobalBatchFeeder(_recording(loader, ids) if loader else None, MICRO, MBS, SEQ)
        tokens, saved = [], None
        for step in range(steps):
            if step == RESUME_AT and loader is not None:
                saved = loader.state_dict()
            tokens.append([mb["tokens"].tolist() for mb in feeder.next_step()])
        return {"tokens": tokens, "ids": ids, "state": saved}

    full = run(None, steps)
    result = {"dp_rank": ps.get_data_parallel_rank(), "reader": world is not None,
              "full": full, "resumed": run(full["state"], steps - RESUME_AT),
              "from_dp1": run(dp1_state, AFTER_DP1)}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    destroy()


def _recording(loader, ids):
    for batch in loader:
        ids.extend(batch["sample_ids"].tolist())
        yield batch


def per_step(ids: list[int]) -> list[list[int]]:
    return [ids[i:i + PER_REPLICA] for i in range(0, len(ids), PER_REPLICA)]


@pytest.mark.slow
def test_tp_peers_share_batches_and_dp_replicas_split_one_sequence(dataset, tmp_path):
    samples = read_index(dataset)["splits"]["train"]["samples"]
    steps = samples // GLOBAL  # one epoch of full global batches
    single = TokenBatches(dataset, "train", GLOBAL, SEQ, ONE, seed=SEED)
    sequence = [b["sample_ids"].tolist() for b in islice(single, RESUME_AT)]
    dp1_state = single.state_dict()
    sequence += [b["sample_ids"].tolist() for b in islice(single, steps - RESUME_AT)]

    mp.spawn(_rank_main, args=(_free_port(), str(dataset), str(tmp_path), steps, dp1_state),
             nprocs=4)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert [(r["dp_rank"], r["reader"]) for r in ranks] == [(0, True), (0, False), (1, True),
                                                            (1, False)]

    # Tensor-parallel peers get identical batches; the replicas get different ones.
    for run in ("full", "resumed", "from_dp1"):
        assert ranks[0][run]["tokens"] == ranks[1][run]["tokens"]
        assert ranks[2][run]["tokens"] == ranks[3][run]["tokens"]
        assert ranks[0][run]["tokens"] != ranks[2][run]["tokens"]
    first, second = ranks[0], ranks[2]

    # Each step the replicas take disjoint halves of the single reader's global batch, so the
    # epoch's full steps cover every sample once (the rest is less than one global batch).
    for step, (a, b) in enumerate(zip(per_step(first["full"]["ids"]),
                                      per_step(second["full"]["ids"]), strict=True)):
        assert not set(a) & set(b)
        assert sorted(a + b) == sorted(sequence[step])
    seen = first["full"]["ids"] + second["full"]["ids"]
    assert len(set(seen)) == len(seen) == steps * GLOBAL > samples - GLOBAL
    assert set(seen) <= set(range(samples))

    # Resumed at RESUME_AT with 2 readers: exactly the uninterrupted continuation, per rank.
    assert first["full"]["state"] == second["full"]["state"]
    for reader in (first, second):
        assert reader["resumed"]["ids"] == reader["full"]["ids"][RESUME_AT * PER_REPLICA:]
    assert ranks[1]["resumed"]["tokens"] == ranks[1]["full"]["tokens"][RESUME_AT:]

    # 2 -> 1 reader: the single reader continues the sequence from the replicas' state.
    resumed = TokenBatches(dataset, "train", GLOBAL, SEQ, ONE, seed=SEED)
    resumed.load_state_dict(first["full"]["state"])
    assert [b["sample_ids"].tolist() for b in islice(resumed, steps - RESUME_AT)] == \
        sequence[RESUME_AT:]
    # 1 -> 2 readers: the replicas continue from the single reader's state.
    for step, (a, b) in enumerate(zip(per_step(first["from_dp1"]["ids"]),
                                      per_step(second["from_dp1"]["ids"]), strict=True)):
        assert sorted(a + b) == sorted(sequence[RESUME_AT + step])
