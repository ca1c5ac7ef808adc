"""What a batch reads from a run directory: its validation curve and whether it is the same
run (``t2train/bench/run_records.py``)."""

from __future__ import annotations

import math

import pytest

from t2train.bench.run_records import check_same_run, finished_curve, val_curve
from t2train.config.loader import dump_config, load_config
from t2train.config.schema import ConfigError


def test_curve_of_a_run_cut_short_by_a_crash(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 0, "val/loss": 8.3}\n{"step": 5, "train/loss": 7.0}\n'
        '{"step": 10, "val/loss": "nan"}\n{"step": 20, "val/lo'
    )  # the last line cut short
    curve = val_curve(tmp_path)
    assert sorted(curve) == [0, 10] and curve[0] == 8.3 and math.isnan(curve[10])
    assert sorted(finished_curve(tmp_path, 10)) == [0, 10]  # a diverged run is finished too
    assert finished_curve(tmp_path, 20) == {}
    assert val_curve(tmp_path / "absent") == {}


def test_a_directory_of_another_configuration_is_refused(tmp_path):
    saved = load_config("tiny", None, ["train.seed=1", "log.run_dir=a", "checkpoint.interval=5"])
    (tmp_path / "config.yaml").write_text(dump_config(saved))
    # checkpointing and logging may differ between the attempts of one run
    check_same_run(load_config("tiny", None, ["train.seed=1", "log.run_dir=b"]), tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"holds a run with train\.seed=1, this batch asks "
        r"for 2",
    ):
        check_same_run(load_config("tiny", None, ["train.seed=2"]), tmp_path)
    check_same_run(saved, tmp_path / "empty")  # nothing saved: nothing to compare
