"""Issue 32's cost targets in the GPU check's report: per timed variant the step time and
peak memory against the baseline of the same run, beside its FLOP ratio (t2train/model/
flops.py), judged against ``targets.yaml``'s ``cost`` limits."""

from __future__ import annotations

import pytest

from t2train.bench.gpu.plan import make_plan
from t2train.bench.gpu.report import cost_targets, write_report
from t2train.bench.variants import variant_config
from t2train.monitor.mfu import model_flops_per_token
from t2train.residual import BASELINE


def _step(name, ratio, memory_ratio):
    return {
        "name": name,
        "status": "ok",
        "step_ms": 100.0 * ratio,
        "params": 1e8,
        "tokens_per_s": 1e5 / ratio,
        "memory_gib": 10.0 * memory_ratio,
    }


def _flops(plan, variant):
    config = variant_config(
        plan.step_preset, None, ["data.path=unused", *plan.step_overrides], variant
    )
    return model_flops_per_token(config.model, config.model.vocab_size)


def test_each_variant_is_judged_on_time_flops_and_memory(tmp_path):
    plan = make_plan(False, "unused")
    cost = plan.settings.cost
    assert cost["max_time_over_flops"] == 1.08 and cost["step_time"]["mhc"] == 1.08
    mixed = f"{BASELINE}+shortswa"
    sections = {
        "step_cost": {
            "items": [
                _step(BASELINE, 1.0, 1.0),
                _step("hc", 1.05, 1.20),  # within all three of its limits
                _step("mhc", 1.10, 1.10),  # over its step-time limit
                _step(
                    "depth_attn", 1.40, 1.30
                ),  # within time / FLOPs (1.497), over its memory limit
                _step(mixed, 1.30, 1.28),  # no step or memory limit: time / FLOPs alone
                {"name": "ddl", "status": "skipped", "reason": "time"},
            ]
        }
    }
    rows = {row["variant"]: row for row in cost_targets(plan, sections)}
    for name in ("hc", "mhc", "depth_attn", mixed):
        assert rows[name]["flop_ratio"] == pytest.approx(
            _flops(plan, name) / _flops(plan, BASELINE)
        )
        assert rows[name]["time_over_flops"] == pytest.approx(
            rows[name]["time_ratio"] / rows[name]["flop_ratio"]
        )
    assert 1.2 < rows[mixed]["flop_ratio"] < 1.3  # the mixer's attention sublayer
    assert {name: row["verdict"] for name, row in rows.items()} == {
        "hc": "met",
        "mhc": "missed",
        "depth_attn": "missed",
        mixed: "met",
        "ddl": "not measured",
        "attnres": "not measured",
        "block_attnres": "not measured",
    }
    report = write_report(plan, sections, tmp_path, 1.0)
    assert report["cost_targets"] == list(rows.values())
    markdown = (tmp_path / "gpu-report.md").read_text()
    assert "## Cost targets (issue 32)" in markdown and "| mhc | 1.100 (<= 1.08) |" in markdown
