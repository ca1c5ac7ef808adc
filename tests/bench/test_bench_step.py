"""`t2train bench step` end to end on a tiny model: two designs and the plain-PyTorch loop."""

from __future__ import annotations

import math

import pytest

from bench_cli import run_cli

pytestmark = pytest.mark.slow

TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
]


def _table_rows(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_step_bench_prints_one_row_per_design_and_the_reference(shakespeare):
    code, out = run_cli(
        "bench",
        "step",
        f"data.path={shakespeare}",
        *TINY,
        "model.shortswa.window=16",
        "--designs",
        "standard,ddl+shortswa",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--repeats",
        "2",
    )
    assert code == 0
    header, separator, *rows = _table_rows(out)
    assert header == [
        "design",
        "params (M)",
        "step time (ms, min)",
        "step time (ms, median)",
        "vs standard (median)",
        "tokens/s (median)",
        "process RSS (GiB)",
        "pipeline data bytes/step",
        "pipeline wire bytes/step",
        "warm-up (s)",
    ]
    assert set(separator) == {"---"}
    assert [row[0] for row in rows] == ["standard", "ddl+shortswa", "plain PyTorch (standard)"]
    for row in rows:
        assert len(row) == len(header)
        assert all(math.isfinite(float(cell)) and float(cell) >= 0 for cell in row[1:])
        assert 0 < float(row[2]) <= float(row[3]) and float(row[5]) > 0
        assert float(row[7]) == float(row[8]) == 0  # no pipeline parallelism
    assert rows[0][4] == "1.00"
    assert rows[0][1] == rows[2][1]  # the reference has the standard model's parameters
    assert "2 timed steps per design" in out  # 2 repetitions x 1 step
    assert "stack overhead" in out and "load average before: " in out
