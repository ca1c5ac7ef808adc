"""The trainer's data path on real processes (spawn, gloo), and elastic resume over data
parallelism: one launch of 4 ranks opens the train stream with the trainer's own
``open_streams`` in several (TP, DP) layouts in turn and feeds steps through
``GlobalBatchFeeder``, recording the sample ids of every step.

The reference is an uninterrupted run at TP=2 x DP=2 (each replica's tensor-rank-0 process
reads and broadcasts to its peer) over more than one epoch. Its loader state, saved as the
trainer saves it (``Streams.shared_state_dict``), resumes at DP=2, DP=4 (TP=1) and DP=1 (TP=4),
and a DP=4 state resumes at DP=2: every resumed step takes exactly the reference step's
samples (none twice, none skipped, across the epoch boundary), and the resumed loaders end
in the reference's position. A change that cannot continue the sequence is refused.
"""

from __future__ import annotations

import json
import os

import pytest
import torch.multiprocessing as mp

from t2train.data.errors import DataError
from t2train.data.index import read_index
from t2train.data.loader import StreamingWorld, TokenBatches, check_node_count

MBS, SEQ, GLOBAL = 2, 32, 8  # micro-batch, sequence length, samples per step (all layouts)
STEPS = 46  # the test dataset's 309 samples make epochs of 38 steps: this crosses one
SAVE_AT = (30, 40)  # loader states are saved after these steps (before and after the boundary)
# (name, TP, DP, the run whose state it resumes, and at which step); "ref" is uninterrupted
RUNS = [
    ("ref", 2, 2, None, 0),
    ("dp2", 2, 2, "ref", 30),
    ("dp4", 1, 4, "ref", 30),
    ("dp1", 4, 1, "ref", 30),
    ("dp4_to_dp2", 2, 2, "dp4", 40),
]


def _recording(loader, ids):
    for batch in loader:
        ids.extend(batch["sample_ids"].tolist())
        yield batch


def _run(path, tp, state, first_step) -> dict:
    """Steps ``first_step + 1 .. STEPS`` of the train stream in layout TP x (4 / TP): every
    rank's tokens per step, the reader's sample ids, and the shared loader states."""
    from megatron.core import parallel_state as ps

    from t2train.config.loader import load_config
    from t2train.parallel.init import init_model_parallel
    from t2train.train.batches import GlobalBatchFeeder
    from t2train.train.data import open_streams

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    topology = init_model_parallel(tp, 1, 1)
    config = load_config(
        overrides=[
            f"data.path={path}",
            f"model.seq_length={SEQ}",
            f"train.micro_batch_size={MBS}",
            f"train.global_batch_size={GLOBAL}",
            f"parallel.tensor={tp}",
            "train.seed=3",
        ]
    )
    streams = open_streams(config, topology, topology.dp_size, state)
    ids: list[int] = []
    micro = GLOBAL // (MBS * topology.dp_size)
    feeder = GlobalBatchFeeder(
        _recording(streams.train, ids) if streams.train else None, micro, MBS, SEQ
    )
    tokens, states = [], {}
    for step in range(first_step + 1, STEPS + 1):
        tokens.append([mb["tokens"].tolist() for mb in feeder.next_step()])
        if step in SAVE_AT or step == STEPS:
            states[step] = streams.shared_state_dict()
    per_step = MBS * micro
    return {
        "dp_rank": topology.dp_rank,
        "reader": streams.train is not None,
        "tokens": tokens,
        "ids": [ids[i : i + per_step] for i in range(0, len(ids), per_step)],
        "states": states,
    }


def _rank_main(rank, path, out_dir):
    import torch.distributed as dist

    from t2train.compat import megatron_cpu
    from t2train.parallel.init import destroy

    os.environ["LOCAL_RANK"] = str(rank)
    megatron_cpu.apply()
    # A file store: no port to pick, none that another job can take first.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=4)
    results: dict = {}
    for name, tp, _, source, at in RUNS:
        results[name] = _run(path, tp, results[source]["states"][at] if source else None, at)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(results, f)  # the states' step keys become strings
    destroy()


def _global_steps(ranks: list[dict], name: str) -> list[list[int]]:
    """Each step's sample ids over all readers, sorted (the order across ranks is free)."""
    readers = [r[name] for r in ranks if r[name]["reader"]]
    return [
        sorted(i for reader in readers for i in reader["ids"][step])
        for step in range(len(readers[0]["ids"]))
    ]


def _position(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "layout"}


@pytest.mark.slow
def test_resume_at_another_data_parallel_size_continues_the_sample_sequence(dataset, tmp_path):
    samples = read_index(dataset)["splits"]["train"]["samples"]
    epoch_steps = samples // GLOBAL
    assert SAVE_AT[0] < epoch_steps < SAVE_AT[1] < STEPS and samples % GLOBAL
    mp.spawn(_rank_main, args=(str(dataset), str(tmp_path)), nprocs=4)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]

    # The reference: tensor-parallel peers get identical batches, the replicas disjoint ones.
    assert [(r["ref"]["dp_rank"], r["ref"]["reader"]) for r in ranks] == [
        (0, True),
        (0, False),
        (1, True),
        (1, False),
    ]
    for name, tp, _, _, _ in RUNS:
        for group in range(0, 4, tp):
            assert all(
                ranks[group + i][name]["tokens"] == ranks[group][name]["tokens"] for i in range(tp)
            ), name
    reference = _global_steps(ranks, "ref")
    assert len(reference) == STEPS and all(len(step) == GLOBAL for step in reference)
    first_epoch = [i for step in reference[:epoch_steps] for i in step]
    second_epoch = [i for step in reference[epoch_steps:] for i in step]
    # Each epoch is cut to whole steps: no sample twice within one, and no step spans two.
    assert len(set(first_epoch)) == len(first_epoch) == epoch_steps * GLOBAL
    assert len(set(second_epoch)) == len(second_epoch)
    assert set(first_epoch) | set(second_epoch) <= set(range(samples))

    ref_states = ranks[0]["ref"]["states"]
    for name, _, dp, _source, at in RUNS[1:]:
        resumed = _global_steps(ranks, name)
        assert resumed == reference[at:], f"{name}: the resumed steps differ"
        states = ranks[0][name]["states"]
        for step, state in states.items():  # the same position at every later save
            assert _position(state) == _position(ref_states[step]), (name, step)
            assert state["layout"] == {
                "readers": dp,
                "nodes": 1,
                "micro_batch_size": MBS,
                "step_samples": GLOBAL,
            }
    assert ref_states[str(SAVE_AT[1])]["epoch"] == 1  # the states cross the epoch boundary too
    # With two readers the same state continues each rank's own sequence, not only the step's.
    for rank in (0, 2):
        assert ranks[rank]["dp2"]["ids"] == ranks[rank]["ref"]["ids"][SAVE_AT[0] :]

    # Another number of samples per step cannot continue the sequence: refused, naming both.
    other = TokenBatches(
        dataset, "train", MBS, SEQ, StreamingWorld(0, 1, 0, 1), seed=3, step_samples=2 * GLOBAL
    )
    with pytest.raises(
        DataError,
        match=r"saved by a run of 2 data-parallel reader\(s\) on 1 "
        r"node\(s\), micro-batch 2, 8 samples per step; this run has 1 "
        r"data-parallel reader\(s\) on 1 node\(s\), micro-batch 2, 16 samples",
    ):
        other.load_state_dict(ref_states[str(SAVE_AT[0])])


def test_node_counts_that_would_reorder_samples_are_refused():
    """Canonical and physical node counts that do not divide one another, fresh or resumed
    (streaming would reorder samples within steps): refused naming both layouts."""
    here = {"readers": 4, "nodes": 2, "micro_batch_size": 2, "step_samples": 8}
    saved = {"readers": 3, "nodes": 3, "micro_batch_size": 1, "step_samples": 8}
    check_node_count(4, here, None)
    check_node_count(1, here, saved)
    with pytest.raises(
        DataError,
        match=r"^num_canonical_nodes=3 and this run's data readers on "
        r"2 nodes \(4 data-parallel reader\(s\) on 2 node\(s\), "
        r"micro-batch 2, 8 samples per step\): one must divide "
        r"the other to keep the sample order$",
    ):
        check_node_count(3, here, None)
    with pytest.raises(
        DataError,
        match=r"num_canonical_nodes=3 \(from the saved data position\)"
        r".*; the position was saved by a run of 3 data-parallel "
        r"reader\(s\) on 3 node\(s\), micro-batch 1",
    ):
        check_node_count(3, here, saved)
