"""The slow-rank report (t2train/monitor/stragglers.py): the forward clock, the comparison of
each rank with the other ranks of its pipeline stage, and a real 4-rank run (PP = 2 x DP = 2,
gloo) in which one rank's model is slowed: its metrics and console name that rank."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from t2train.config.loader import load_config
from t2train.errors import ConfigError
from t2train.monitor.stragglers import (
    ForwardClock,
    RankTimes,
    slowest_rank,
    straggler_scalars,
    straggler_warning,
)

from torchrun_helper import REPO, child_env, faulty_train_command


def test_the_forward_clock_counts_the_timed_passes_since_it_was_last_read():
    clock = ForwardClock()
    for _ in range(2):
        with clock.timing():
            time.sleep(0.03)
    time.sleep(0.05)  # outside a pass: not counted
    assert 0.06 <= clock.take() < 0.1
    assert clock.take() == 0.0


def _times(stages: list[list[float]]) -> list[RankTimes]:
    """Ranks numbered stage by stage; rank r waited r ms per step for data."""
    ranks = [(stage, ms) for stage, row in enumerate(stages) for ms in row]
    return [
        RankTimes(rank, f"node{rank // 2}", stage, ms, float(rank))
        for rank, (stage, ms) in enumerate(ranks)
    ]


def test_a_rank_is_compared_with_the_median_of_the_other_ranks_of_its_stage():
    # stage 0: 10, 12, 11 ms; stage 1 (the loss: slower for all) 30, 31, 62, 29 ms
    times = _times([[10.0, 12.0, 11.0], [30.0, 31.0, 62.0, 29.0]])
    slow = slowest_rank(times)
    assert slow is not None and slow.times.rank == 5 and slow.peers == 3
    assert slow.peers_ms == 30.0  # median of 30, 31, 29
    assert slow.ratio == pytest.approx(62.0 / 30.0)
    # a whole stage slower than another is the work it does, not a straggler
    even = slowest_rank(_times([[10.0, 10.0], [40.0, 40.0]]))
    assert even is not None and even.ratio == 1.0
    # a stage of one rank has no peers: nothing to compare
    assert slowest_rank(_times([[10.0], [40.0]])) is None


def test_the_scalars_and_the_console_line_name_the_slow_rank():
    times = _times([[10.0, 12.0, 11.0], [30.0, 31.0, 62.0, 29.0]])
    assert straggler_scalars(times) == {
        "stragglers/data_wait_ms_max": 6.0,
        "stragglers/data_wait_rank": 6,
        "stragglers/forward_ratio": pytest.approx(62.0 / 30.0),
        "stragglers/forward_rank": 5,
        "stragglers/forward_ms_slowest": 62.0,
        "stragglers/forward_ms_peers": 30.0,
    }
    assert straggler_warning(times, 1.25) == (
        "slow rank: rank 5 (host node2, pipeline stage 1) spent 62.0 ms per step in forward "
        "passes, 2.07x the median of the other 3 rank(s) of its stage (30.0 ms; "
        "log.straggler_factor=1.25); it waited 5.0 ms per step for data"
    )
    assert straggler_warning(times, 2.5) is None  # below the factor
    assert straggler_warning(times, 0) is None  # never
    assert straggler_warning(_times([[10.0], [40.0]]), 1.25) is None
    assert straggler_scalars(_times([[10.0], [40.0]])) == {
        "stragglers/data_wait_ms_max": 1.0,
        "stragglers/data_wait_rank": 1,
    }


@pytest.mark.parametrize("factor", ["1", "0.5", "-1"])
def test_a_straggler_factor_of_one_or_less_is_refused(factor):
    with pytest.raises(ConfigError, match=re.escape("log.straggler_factor")):
        load_config(overrides=["data.path=unused", f"log.straggler_factor={factor}"])
    load_config(overrides=["data.path=unused", "log.straggler_factor=0"])


@pytest.mark.slow
def test_a_slowed_rank_is_named_among_the_ranks_of_its_stage(shakespeare, tmp_path):
    """Rank 3 (stage 1 of PP = 2, data-parallel rank 1) sleeps 0.25 s at each forward pass
    (tests/workers/faulty_train.py): 0.5 s per step over its 2 micro-batches, against a few
    ms of the tiny model's forward on its peer, rank 2."""
    run_dir = tmp_path / "run"
    cmd = faulty_train_command(
        4,
        "slow_forward",
        1,
        [
            "model.num_layers=2",
            "model.hidden_size=32",
            "model.num_attention_heads=2",
            "model.num_query_groups=1",
            "model.seq_length=32",
            "parallel.pipeline=2",
            "train.micro_batch_size=2",
            "train.global_batch_size=8",
            "train.steps=6",
            "train.log_interval=2",
            "train.eval_interval=1000",
            "train.eval_batches=1",
            "log.tensorboard=false",
            "log.diagnostics_interval=0",
            "checkpoint.interval=1000",
            f"data.path={shakespeare}",
            f"log.run_dir={run_dir}",
        ],
    )
    proc = subprocess.run(
        cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "stragglers/forward_rank" in r]
    assert [r["step"] for r in logged] == [4, 6]  # not the first interval: warm-up
    for record in logged:
        assert record["stragglers/forward_rank"] == 3
        assert record["stragglers/forward_ms_slowest"] >= 500.0
        assert record["stragglers/forward_ratio"] > 2.0
    lines = re.findall(
        r"step +\d+ \| slow rank: rank (\d) \(host [^,]+, pipeline stage (\d)\)", output
    )
    assert lines == [("3", "1"), ("3", "1")], output[-4000:]
