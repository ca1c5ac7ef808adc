"""`t2train experiment compare` end to end: two designs, one seed, a few steps."""

from __future__ import annotations

import math

import pytest
from bench_cli import run_cli

pytestmark = pytest.mark.slow

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.seq_length=64", "train.micro_batch_size=4", "train.global_batch_size=8",
        "train.warmup_steps=2", "train.eval_batches=2", "log.tensorboard=false"]


def test_compare_writes_a_table_and_one_run_per_design_and_seed(shakespeare, tmp_path):
    out = tmp_path / "compare"
    code, printed = run_cli("experiment", "compare", f"data.path={shakespeare}", *TINY,
                            "model.shortswa.window=16", "--designs", "standard,ddl+shortswa",
                            "--seeds", "1", "--steps", "5",
                            "--out", str(out))
    assert code == 0
    text = (out / "compare.md").read_text()
    assert text.strip() in printed
    header, separator, *rows = [[cell.strip() for cell in line.strip("|").split("|")]
                                for line in text.splitlines()]
    assert header == ["design", "seeds", "mean val loss", "std", "min-max", "tokens",
                      "train FLOPs/token", "total train FLOPs", "params (M)"]
    assert set(separator) == {"---"}
    assert [row[0] for row in rows] == ["standard", "ddl+shortswa"]
    for row in rows:
        assert row[1] == "1" and float(row[3]) == 0.0
        assert 0 < float(row[2]) < math.log(2048)  # below uniform over the padded vocabulary
        assert int(row[5]) == 5 * 8 * 64
        assert float(row[7]) == pytest.approx(float(row[6]) * int(row[5]), rel=1e-3)
    assert sorted(p.name for p in out.iterdir()) == ["compare.md", "ddl+shortswa-seed1234",
                                                     "standard-seed1234"]
