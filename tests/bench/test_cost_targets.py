"""The design targets in the GPU check's report: per variant the step time at 125m and 1b and
the peak memory against the baseline of the same run, beside its FLOP ratio (t2train/model/
flops.py), judged against ``targets.yaml``'s ``designs`` limits; each ``<design>+shortswa``
against the design's ratio x ``standard+shortswa``'s x the mixer's margin."""

from __future__ import annotations

import pytest

from t2train.bench.variants import variant_config
from t2train.monitor.mfu import model_flops_per_token
from t2train.residual import BASELINE
from tools.gpu_check.plan import make_plan
from tools.gpu_check.report import design_targets, write_report


def _step(name, ratio, memory_ratio=1.0):
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


def test_each_variant_is_judged_on_its_design_targets(tmp_path):
    plan = make_plan(False, "unused")
    designs = plan.settings.designs
    assert designs["ddl"] == {"step_time": {"125m": 1.05, "1b": 1.03}, "peak_memory": 1.10}
    assert designs["depth_attn"] == {"step_time": {}, "time_over_flops": 1.08, "peak_memory": 1.25}
    assert plan.settings.mixer_margin == 1.03
    mixer = f"{BASELINE}+shortswa"
    sections = {
        "step_cost": {
            "items": [
                _step(BASELINE, 1.0),
                _step("ddl", 1.04, 1.05),  # 125m and memory met; 1b below
                _step("hc", 1.10, 1.25),  # time met, memory over 1.20
                _step("mhc", 1.20),  # over 1.15
                _step("depth_attn", 1.40, 1.20),  # time / FLOPs 1.40 / 1.49: met
                _step(mixer, 1.30),  # time / FLOPs: 1.30 / 1.24 = 1.05, met
                _step("ddl+shortswa", 1.04 * 1.30 * 1.03),  # at the product rule's limit
                _step("hc+shortswa", 1.10 * 1.30 * 1.03 + 0.01),  # over it
                {"name": "attnres", "status": "skipped", "reason": "time"},
            ]
        },
        "mfu": {
            "items": [
                _step(BASELINE, 1.0),
                _step("ddl", 1.05),  # over 1.03 at 1b
                _step("hc", 1.05),
            ]
        },
    }
    rows = {row["variant"]: row for row in design_targets(plan, sections)}
    assert set(rows) == {*designs, *(f"{d}+shortswa" for d in designs if "+" not in d)} - {
        mixer
    } | {mixer}
    for name in ("depth_attn", mixer):
        assert rows[name]["flop_ratio"] == pytest.approx(
            _flops(plan, name) / _flops(plan, BASELINE)
        )
        assert rows[name]["time_over_flops"] == pytest.approx(
            rows[name]["time_ratios"]["125m"] / rows[name]["flop_ratio"]
        )
    assert 1.2 < rows[mixer]["flop_ratio"] < 1.3  # the mixer's attention sublayer
    assert {name: row["verdict"] for name, row in rows.items()} == {
        "ddl": "missed",  # 1b: 1.05 > 1.03
        mixer: "met",
        "block_attnres": "not measured",
        "hc": "missed",  # memory
        "mhc": "missed",  # 125m; its 1b step not timed
        "attnres": "not measured",
        "depth_attn": "met",
        "ddl+shortswa": "met",
        "depth_attn+shortswa": "not measured",
        "attnres+shortswa": "not measured",  # attnres not timed: no limit
        "block_attnres+shortswa": "not measured",
        "hc+shortswa": "missed",
        "mhc+shortswa": "not measured",
    }
    assert [check["verdict"] for check in rows["ddl"]["checks"]] == ["met", "missed", "met"]
    (product,) = rows["hc+shortswa"]["checks"]
    assert product["limit"] == pytest.approx(1.10 * 1.30 * 1.03)
    report = write_report(plan, sections, tmp_path, 1.0)
    assert report["design_targets"] == list(rows.values())
    markdown = (tmp_path / "gpu-report.md").read_text()
    assert "## Design targets: against `standard` of the same run" in markdown
    assert "| mhc | 1.200 (<= 1.15x) |  (<= 1.08x) | 1.018 |" in markdown
    assert "hc+shortswa: step time (125m) <= hc's x standard+shortswa's x 1.03 = 1.473x" in (
        markdown
    )
