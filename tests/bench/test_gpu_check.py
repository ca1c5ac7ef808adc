"""The GPU check: its CPU rehearsal end to end (the dry run with one item per section: every
section's code once), the target verdicts, the variant lists (every registered design, from
the plan's functions) and the offline installer's rule (never replace an installed
distribution)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from t2train.bench.step import COMPILED_REFERENCE, REFERENCE
from t2train.residual import BASELINE, registered
from tools.gpu_check.plan import (
    QUALITY_SECTIONS,
    QUICK_SECTIONS,
    SECTIONS,
    SPEED_SECTIONS,
    correctness_variants,
    load_settings,
    make_plan,
    mfu_variants,
    mixer_variants,
    step_variants,
)
from tools.gpu_check.report import evaluate_targets

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_reports_every_section(shakespeare, tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.gpu_check.check",
            "--rehearse",
            "--out",
            str(out),
            "--data",
            str(shakespeare),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    markdown = (out / "gpu-report.md").read_text()
    assert markdown.startswith("# t2train GPU check: CPU") and "**CPU dry run**" in markdown
    report = json.loads((out / "gpu-report.json").read_text())
    sections = report["sections"]
    assert report["dry_run"] and list(sections) == list(SECTIONS)
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(SECTIONS, "ok")

    correctness = sections["correctness"]  # the plan's first variant: its lists are below
    assert [item["variant"] for item in correctness["items"]] == [
        correctness_variants(registered())[0]
    ]
    assert all(
        item["status"] == "pass" and len(item["losses"]) == 2 for item in correctness["items"]
    )
    counts = correctness["data"]["gpu_tests"]["counts"]
    assert counts["skipped"] > 0 and counts["passed"] == counts["failed"] == counts["error"] == 0

    steps = sections["step_cost"]["items"]
    settings = load_settings()
    base = step_variants(settings, registered())[0]
    assert [item["name"] for item in steps] == [base, COMPILED_REFERENCE, REFERENCE]
    assert all(item["step_ms"] > 0 and item["warmup_s"] > 0 for item in steps)
    mfu = sections["mfu"]["items"]  # the baseline on the fused path, and both loops
    assert [item["name"] for item in mfu] == [BASELINE, COMPILED_REFERENCE, REFERENCE]
    assert "the tokens/s and" in markdown and "warm-up (s)" in markdown

    (kernel,) = sections["kernels"]["items"]  # the first case of the table's benchmarks
    triton = [row for row in kernel["rows"] if row["impl"] == "triton"]
    assert triton and all(row["ms"] > 0 and row["vs_best_peer"] > 0 for row in triton)

    profiled = sections["profile"]["items"]
    assert [item["name"] for item in profiled] == [base]
    for item in profiled:  # the kinds and the heaviest kernels add up within the total
        assert item["ms_per_step"] > 0 and 0 < len(item["top"]) <= 8
        assert sum(item["kinds"].values()) == pytest.approx(item["ms_per_step"])
        assert sum(top["ms"] for top in item["top"]) <= item["ms_per_step"] * (1 + 1e-9)
    assert "## Where the step time goes" in markdown

    targets = report["targets"]
    assert {t["section"] for t in targets} == {"step_cost", "mfu", "kernels"}
    assert {t["verdict"] for t in targets} <= {"met", "missed", "not measured"}
    (mfu_target,) = [t for t in targets if "MFU" in t["target"]]
    assert mfu_target["verdict"] == "not measured"  # no data-sheet peak on a CPU
    # The headline rows keep their repeats (one in a rehearsal) and every step's time.
    (first, _) = report["headline"]
    assert [row["name"] for row in first["rows"]] == [base, COMPILED_REFERENCE, REFERENCE]
    assert all(len(item["step_samples_ms"]) == 1 for item in steps + mfu)
    assert [len(item.get("repeats", [])) for item in steps] == [1, 1, 0]
    assert "## Headline" in markdown and "MFU % 6N+12Lhs" in markdown


@pytest.mark.slow
def test_quick_dry_run_compiles_the_headline_items_first(shakespeare, tmp_path):
    """``--quick``'s dry run: the step-cost section on the fused path as the GPU runs it (each
    layer compiled, with aot_eager here, and the Triton kernels, under the interpreter), the
    baseline and the block-compiled plain loop first, every item measured with its compile in
    the warm-up column. (The MFU section orders its items the same way, by the same code:
    test_dry_run_reports_every_section.)"""
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.gpu_check.check",
            "--rehearse",
            "--quick",
            "--only",
            "step_cost",
            "--out",
            str(out),
            "--data",
            str(shakespeare),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sections = json.loads((out / "gpu-report.json").read_text())["sections"]
    assert sections["step_cost"]["status"] == "ok"
    steps = sections["step_cost"]["items"]
    assert [item["name"] for item in steps] == [BASELINE, COMPILED_REFERENCE, REFERENCE]
    assert all(item["status"] == "ok" and item["warmup_s"] > 0 for item in steps), steps


def _step(name, step_ms, reference=False, memory=10.0, **extra):
    return {
        "name": name,
        "status": "ok",
        "step_ms": step_ms,
        "reference": reference,
        "tokens_per_s": 1000.0 / step_ms,
        "memory_gib": memory,
        **extra,
    }


def _compiled(step_ms, memory):
    return dict(_step(COMPILED_REFERENCE, step_ms, reference=True, memory=memory), compiled=True)


def _kernels(*vs_best_peer):
    rows = [
        {
            "kernel": "k",
            "preset": "p",
            "shape": "s",
            "impl": "triton",
            "ms": 1.0,
            "vs_best_peer": v,
        }
        for v in vs_best_peer
    ]
    return {"items": [{"status": "ok", "rows": rows}]}


def test_targets_are_judged_from_the_sections():
    """The headline against the strongest reference (the eager loop where it beat the
    compiled one), MFU by the causal count with 6N + 12Lhs beside it, every design's limits,
    the planner and the kernels, each naming its section."""
    plan = make_plan(False, "unused")
    flops = {"flops_per_token": 1e10, "flops_per_token_6n": 1.2e10}
    sections = {
        "env": {"data": {"matmul": {"tflops": 800.0}, "datasheet_bf16_tflops": 1000.0}},
        "step_cost": {
            "items": [
                _step(BASELINE, 100.0, plan_gib=9.0, plan_ratio=10 / 9, plan_verdict="met"),
                _compiled(111.0, 12.0),  # 1.11x: met against it ...
                _step(REFERENCE, 109.0, reference=True, memory=9.0),  # ... the eager one wins
                _step("ddl", 104.0, plan_gib=7.7, plan_ratio=1.3, plan_verdict="missed"),
                {"name": "hc", "status": "skipped", "reason": "time"},
            ]
        },
        "mfu": {
            "data": {"datasheet_tflops": 1000.0, **flops},
            "items": [
                _step(BASELINE, 1.0, tokens_per_s=5.6e4, **flops),
                dict(_compiled(1.0, 9.0), tokens_per_s=5e4),
            ],
        },
        "kernels": _kernels(1.3, 0.9),
    }
    targets = evaluate_targets(plan, sections)
    judged = {t["target"]: t for t in targets}
    by_start = {t["target"].split(":")[0].split(" (")[0]: t["verdict"] for t in targets}
    assert [t["verdict"] for t in targets[:5]] == ["missed", "missed", "met", "missed", "met"]
    assert "vs `plain PyTorch (standard)`" in targets[0]["measured"]  # the strongest, eager
    assert targets[2]["measured"].startswith("1.120x")  # 1b: 5.6e4 / 5e4 tokens/s
    assert targets[4]["measured"] == "56.0% (6N + 12Lhs: 67.2%)"  # 5.6e4 x 1e10 of 1000 TFLOP/s
    assert by_start["ddl"] == "not measured"  # 125m met, 1b not timed
    assert (
        "step time (125m) 1.040: met"
        in judged[next(t for t in judged if t.startswith("ddl:"))]["measured"]
    )
    assert by_start["hc"] == "not measured"
    assert [t["section"] for t in targets[-2:]] == ["step_cost", "kernels"]
    assert [t["verdict"] for t in targets[-2:]] == ["missed", "missed"]  # planner 1.3x; 0.9x
    assert "1 of 2; worst ddl 1.30x" in targets[-2]["measured"]

    sections["mfu"]["items"][0]["tokens_per_s"] = 5.4e4  # 54% < 55%
    assert (
        next(t for t in evaluate_targets(plan, sections) if "MFU" in t["target"])["verdict"]
        == "missed"
    )
    sections["mfu"]["items"].pop()  # no reference at 1b: its two targets not measured
    assert [t["verdict"] for t in evaluate_targets(plan, sections)][2:4] == ["not measured"] * 2
    kernel_rows = sections["kernels"]["items"][0]["rows"]
    kernel_rows[1].update(vs_best_peer=1.1)
    assert evaluate_targets(plan, sections)[-1]["verdict"] == "met"
    kernel_rows.append(dict(kernel_rows[0], ms=None, vs_best_peer=None, error="CompileError"))
    judged_kernels = evaluate_targets(plan, sections)[-1]  # a kernel that does not run is not fast
    assert judged_kernels["verdict"] == "missed" and "1 failed to run" in judged_kernels["measured"]
    # A report lists the targets of its own sections: --quality has the kernels' only.
    quality = make_plan(False, "unused", mode="quality")
    assert [t["section"] for t in evaluate_targets(quality, sections)] == ["kernels"]


def _timing(step_ms: list[float], warmup_s: float = 1.0, memory: float = 10.0):
    from t2train.bench.step import DesignTiming

    return DesignTiming(
        "x",
        1000,
        [ms / 1e3 for ms in step_ms],
        4096,
        memory,
        {},
        warmup_seconds=warmup_s,
        warmup_samples=[warmup_s],
    )


def test_the_headline_rows_are_timed_in_turns_and_kept_whole(tmp_path, monkeypatch):
    """t2train, reference, t2train, reference, ...: each row keeps every repeat and every
    step's time, its step time is the median of all its steps, its spread is flagged over
    5%; a repeat that does not fit the section's time is named, the row keeps the rest."""
    import time

    from tools.gpu_check import perf
    from tools.gpu_check.check import Section

    plan = make_plan(False, "unused")
    assert plan.repeats == 3 and plan.settings.max_spread == 0.05
    calls: list[str] = []
    ours = iter([[100.0, 102.0], [101.0, 103.0], [100.0, 104.0]])
    theirs = iter([[120.0, 121.0], [130.0, 131.0], [122.0, 124.0]])

    def measure(name, samples):
        def run():
            calls.append(name)
            return _timing(next(samples))

        return run

    monkeypatch.setattr(perf, "flop_counts", lambda model, vocab: {"flops_per_token": 1.0})
    monkeypatch.setattr(
        perf.Headline, "reference", lambda self, compiled: measure("reference", theirs)
    )
    section = Section("mfu", tmp_path / "mfu.json", time.time() + 600, tmp_path)
    headline = perf.Headline(
        section, plan, config=type("C", (), {"model": None}), vocab=1, batches=[], warmup=1
    )
    headline.run(measure("t2train", ours))
    assert calls == ["t2train", "reference"] * 3
    base, reference = json.loads((tmp_path / "mfu.json").read_text())["items"]
    assert base["name"] == BASELINE and base["headline"] and not base.get("reference")
    assert reference["name"] == COMPILED_REFERENCE and reference["compiled"]
    assert base["step_samples_ms"] == [100.0, 102.0, 101.0, 103.0, 100.0, 104.0]
    assert base["step_ms"] == 101.5 and base["tokens_per_s"] == pytest.approx(4096 / 0.1015)
    assert [r["step_ms"] for r in base["repeats"]] == pytest.approx([101.0, 102.0, 102.0])
    assert base["spread"] == pytest.approx(102 / 101 - 1) and not base["repeats_differ"]
    assert reference["spread"] == pytest.approx(130.5 / 120.5 - 1) and reference["repeats_differ"]
    assert base["warmup_s"] == 1.0 and base["seconds"] > 0

    # A repeat that would not fit: skipped with its reason; the row keeps what it has.
    calls.clear()
    ours = iter([[100.0]])
    section = Section("step_cost", tmp_path / "s.json", time.time() + 600, tmp_path)
    headline = perf.Headline(
        section, plan, config=type("C", (), {"model": None}), vocab=1, batches=[], warmup=1
    )
    monkeypatch.setattr(section, "fits", lambda estimate: not calls)
    headline.run(measure("t2train", ours))
    (only,) = section.result["items"][:1]
    assert len(only["repeats"]) == 1 and len(only["repeats_not_run"]) == 2
    assert section.result["items"][1]["status"] == "skipped"  # the reference: no time at all


def test_the_report_gives_the_spread_and_mfu_by_both_counts(tmp_path):
    """The headline table: each row's repeats, the spread (flagged over 5%), MFU by the
    causal count and by 6N + 12Lhs; the JSON keeps every step's time."""
    from tools.gpu_check.items import summary_of_repeats
    from tools.gpu_check.report import write_report

    plan = make_plan(False, "unused")

    def row(name, medians, **extra):
        repeats = [
            {"step_ms": ms, "memory_gib": 10.0, "warmup_s": 2.0, "step_samples_ms": [ms, ms]}
            for ms in medians
        ]
        return {
            "name": name,
            "status": "ok",
            "headline": True,
            "params": 1e8,
            "flops_per_token": 1e9,
            "flops_per_token_6n": 1.5e9,
            **summary_of_repeats(repeats, 65536, plan.settings.max_spread),
            **extra,
        }

    sections = {
        "env": {"data": {"datasheet_bf16_tflops": 1000.0, "matmul": {"n": 8192, "tflops": 800.0}}},
        "step_cost": {
            "status": "ok",
            "data": {"preset": "125m", "repeats": 3},
            "items": [
                row(BASELINE, [100.0, 101.0, 106.0]),  # 6% apart: flagged
                row(COMPILED_REFERENCE, [120.0, 121.0, 122.0], reference=True, compiled=True),
            ],
        },
    }
    report = write_report(plan, sections, tmp_path, 1.0)
    (block,) = report["headline"]
    ours, theirs = block["rows"]
    assert ours["repeats_ms"] == [100.0, 101.0, 106.0] and ours["repeats_differ"]
    assert not theirs["repeats_differ"]
    assert block["versus"]["speed"] == pytest.approx(121 / 101)
    assert block["versus"]["speed_by_repeat"] == pytest.approx([1.2, 121 / 101, 122 / 106])
    # 65,536 tokens / 101 ms x 1e9 FLOPs = 648.9 TFLOP/s: 64.9% of the data sheet
    assert ours["mfu"] == pytest.approx(65536 / 0.101 * 1e9 / 1e15)
    assert ours["mfu_6n"] == pytest.approx(1.5 * ours["mfu"])
    saved = json.loads((tmp_path / "gpu-report.json").read_text())
    assert saved["sections"]["step_cost"]["items"][0]["step_samples_ms"] == [
        100.0,
        100.0,
        101.0,
        101.0,
        106.0,
        106.0,
    ]
    markdown = (tmp_path / "gpu-report.md").read_text()
    assert "| 125m | standard | 101.0 | 100.0 / 101.0 / 106.0 | 6.0% (> 5%) |" in markdown
    assert "its repeats differ by 6.0% (more than 5%)" in markdown
    assert "| 64.9 / 81.1 | 97.3 / 121.7 |" in markdown  # causal, 6N: sheet / measured
    assert "1.198x vs `plain PyTorch, compiled (standard)` (repeats 1.151-1.200x)" in (markdown)


def test_flops_by_both_conventions():
    """6N + 12*L*h*s (N: the parameters a token multiplies) beside t2train's causal count, at
    the 1b preset (untied embeddings) and the 125m preset (tied)."""
    from t2train.bench.variants import variant_config
    from t2train.model.flops import parameters
    from tools.gpu_check.items import flop_counts

    for preset, vocab in (("1b", 32000), ("125m", 32000)):
        model = variant_config(preset, None, ["data.path=unused"], BASELINE).model
        counts = flop_counts(model, vocab)
        h, layers, s = model.hidden_size, model.num_layers, model.seq_length
        n = parameters(model, vocab) - (0 if model.tie_embeddings else vocab * h)
        assert counts["flops_per_token_6n"] == 6 * n + 12 * layers * h * s
        # full against causal attention: 12 L h s against 6 L h (s + 1); the rest differs by
        # the norms' parameters (in N, no matmul in the causal count)
        attention = 12 * layers * h * s - 6 * layers * h * (s + 1)
        norms = 6 * (2 * h * layers + h)
        assert counts["flops_per_token_6n"] - counts["flops_per_token"] == attention + norms


def test_the_comparison_section_trains_until_its_time_is_up(tmp_path, monkeypatch):
    """--quality's last section: the batch resumed from the records committed so far, trained
    for the section's time less the report's reserve, the runs finished now in OUT/records;
    a failed batch with no run finished fails the section."""
    import time

    from tools.gpu_check import compare
    from tools.gpu_check.check import Section

    plan = make_plan(False, "data", mode="quality", out=str(tmp_path / "out"))
    asked = {}

    def share(kept, records, budget_min, data, dry_run, log):
        asked.update(kept=kept, records=records, budget_min=budget_min, data=data)
        log.write_text("trained\n")
        return {"earlier": ["standard-seed1234"], "new": ["ddl-seed1234"], "exit": 0}

    monkeypatch.setattr(compare, "share", share)
    section = Section("comparison", tmp_path / "c.json", time.time() + 200, tmp_path)
    compare.section(section, plan)
    assert asked["kept"] == tmp_path / "out" / "records" and asked["records"] == compare.RECORDS
    assert asked["data"] == compare.DATA
    assert 2.9 < asked["budget_min"] <= (200 - compare.REPORT_RESERVE_S) / 60
    assert [item["name"] for item in section.result["items"]] == ["ddl-seed1234"]
    assert section.data["runs_in_batch"] == 30 and section.data["log_tail"] == ["trained"]

    monkeypatch.setattr(compare, "share", lambda *args: {"earlier": [], "new": [], "exit": 1})
    with pytest.raises(RuntimeError, match="exit 1"):
        compare.section(section, plan)


def test_the_compiled_loss_keeps_no_fp32_logits():
    """The reference's loss, compiled as Inductor partitions it (its decompositions, the
    min-cut partitioner): the backward keeps the bf16 logits and a few fp32 numbers per
    token, never an fp32 [tokens, vocabulary] tensor."""
    import torch
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    from t2train.bench.reference_gpt import head_loss

    tokens, width, vocab = 64, 32, 1000
    saved = []

    def forward(graph, inputs):
        (outputs,) = [node.args[0] for node in graph.graph.nodes if node.op == "output"]
        saved.extend(node.meta["val"] for node in outputs[1:])
        return graph.forward

    backend = aot_autograd(
        fw_compiler=forward,
        bw_compiler=lambda graph, inputs: graph.forward,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    x = torch.randn(2, tokens // 2, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.compile(head_loss, backend=backend)(
            x, torch.ones(width), 1e-5, weight, torch.randint(0, vocab, (2, tokens // 2))
        )
    loss.backward()
    wide = [(t.dtype, tuple(t.shape)) for t in saved if t.dim() == 2 and t.shape[-1] == vocab]
    assert wide == [(torch.bfloat16, (tokens, vocab))]


def test_the_reference_process_answers_each_spec(tmp_path):
    """``--serve``: one answer per spec, an error as an answer (the parent reports it and
    the next run goes on)."""
    from t2train.bench.reference_gpt import RESULT, serve

    answers: list[str] = []
    serve(["", json.dumps({"batches": str(tmp_path / "missing.pt")}) + "\n"], answers.append)
    (answer,) = answers
    assert answer.startswith(RESULT) and json.loads(answer[len(RESULT) :])["error"]


def test_the_quick_plan_times_the_baseline_and_the_targets_within_four_minutes():
    plan = make_plan(False, "unused", quick=True)
    assert plan.sections == QUICK_SECTIONS and "profile" in QUICK_SECTIONS
    assert sum(plan.budgets[name] for name in plan.sections) <= 240
    assert step_variants(plan.settings, registered(), quick=True) == [
        BASELINE,
        *plan.settings.designs,
    ]
    assert mixer_variants(plan.settings, registered(), quick=True) == []
    full = make_plan(False, "unused")
    assert sum(full.budgets[name] for name in full.sections) <= 590  # one 10-minute command


def test_the_gpu_window_is_two_ten_minute_calls():
    """--speed: the headline at both presets (three repeats), every variant, the profiles;
    --quality: correctness, every kernel row, the comparison. Each plans at most 540 s, so
    that the bundle's install and the worker's start fit beside it in 10 minutes; the
    rehearsal runs one repeat of each headline row."""
    speed = make_plan(False, "unused", mode="speed")
    quality = make_plan(False, "unused", mode="quality")
    assert speed.sections == SPEED_SECTIONS and quality.sections == QUALITY_SECTIONS
    assert set(SPEED_SECTIONS) | set(QUALITY_SECTIONS) == set(SECTIONS) | {"comparison"}
    for plan in (speed, quality):
        assert sum(plan.budgets[name] for name in plan.sections) <= 540
    assert speed.repeats == 3 and make_plan(True, "unused", rehearsal=True).repeats == 1
    assert mfu_variants(speed.settings) == [BASELINE, "ddl", "hc", "mhc"]  # targets at 1b


def test_every_registered_design_is_timed_and_trained():
    settings = load_settings()
    alone, mixed = step_variants(settings, registered()), mixer_variants(settings, registered())
    assert alone[0] == BASELINE and set(settings.designs) <= set(alone)
    assert set(registered()) <= set(alone)
    assert sorted(alone + mixed) == sorted(set(alone + mixed))  # each once
    assert {name.split("+")[0] for name in alone + mixed if "+" in name} == set(registered())
    later = ("future_design",)
    assert "future_design" in step_variants(settings, registered() + later)
    assert "future_design" in correctness_variants(registered() + later)


def test_installer_keeps_what_is_installed_and_reports_what_fails(tmp_path):
    from tools.gpu_check import install as installer

    present = tmp_path / "PyYAML-0.0.1-py3-none-any.whl"  # installed here: must be kept
    broken = tmp_path / "t2train_no_such_dist-1.0-py3-none-any.whl"  # not a wheel: pip fails
    present.write_bytes(b"")
    broken.write_bytes(b"")
    kept, failed = installer.install_wheels([present, broken])
    assert kept.startswith("kept     pyyaml ") and "0.0.1" in kept
    assert failed.startswith("FAILED   t2train_no_such_dist-1.0")


def test_the_device_entry_point_names_its_one_argument(capsys):
    from tools.gpu_check.__main__ import main

    assert main([]) == 2
    assert "usage: python3 -m tools.gpu_check OUT_DIR" in capsys.readouterr().err


def test_a_failure_is_reported_with_what_locates_it(tmp_path):
    """The first GPU run reported a test as 'Tensor-likes are not close!' and a variant as
    'Triton Error [CUDA]: invalid argument', with nothing to tell by how much or where: the
    report keeps assert_close's numbers and the item's traceback."""
    import time

    from tools.gpu_check.check import Section
    from tools.gpu_check.correctness import _junit_items
    from tools.gpu_check.perf import _timed

    message = (
        "gradient of input 0: Tensor-likes are not close!\n\nMismatched elements: 1 / 24"
        "\nGreatest absolute difference: 0.04 at index (17,) (up to 0.02 allowed)"
    )
    junit = tmp_path / "junit.xml"
    junit.write_text(
        f'<testsuite><testcase classname="t.m" name="test_bf16">'
        f'<failure message="{message.replace(chr(10), "&#10;")}">trace</failure>'
        "</testcase></testsuite>"
    )  # newlines escaped, as pytest writes them
    (item,) = _junit_items(junit)
    assert item["outcome"] == "failed" and "Greatest absolute difference: 0.04" in item["message"]

    def launch_a_kernel():
        raise RuntimeError("Triton Error [CUDA]: invalid argument")

    section = Section("step_cost", tmp_path / "step_cost.json", time.time() + 60, tmp_path)
    _timed(section, "depth_attn", launch_a_kernel, estimate=1.0)
    (item,) = json.loads((tmp_path / "step_cost.json").read_text())["items"]
    assert item["status"] == "error" and item["reason"].endswith("invalid argument")
    assert "launch_a_kernel" in item["traceback"]


@pytest.mark.parametrize(
    "kernel, kind",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "matmul"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "attention"),
        ("_dkdv_kernel", "t2train triton"),
        ("_phase1_bwd_grads_kernel", "t2train triton"),
        ("_write_fwd", "t2train triton"),
        ("_one_query_bwd_kernel", "t2train triton"),
        ("triton_poi_fused_add_mul_0", "torch.compile"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
            "elementwise / reduction",
        ),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
    ],
)
def test_profile_sorts_kernels_by_kind(kernel, kind):
    from tools.gpu_check.profile import kind_of

    assert kind_of(kernel) == kind


def test_gpu_tests_stopped_at_their_share_still_report_what_ran():
    """pytest writes its junit file only at the end; a run stopped at its time share (the
    second GPU run: 0 results from 62 s of tests) is read from its verbose lines."""
    from tools.gpu_check.correctness import _verbose_items

    printed = (
        b"tests/kernels/test_attnres_kernel.py::test_bf16[partial] PASSED  [  6%]\n"
        b"tests/kernels/test_window_kernel.py::test_bf16[gqa] FAILED  [ 12%]\n"
        b"tests/launch/test_launcher.py::test_more_processes SKIPPED (no corpus) [ 18%]\n"
    )
    assert _verbose_items(printed) == [
        {
            "test": "tests.kernels.test_attnres_kernel::test_bf16[partial]",
            "outcome": "passed",
            "message": "",
        },
        {
            "test": "tests.kernels.test_window_kernel::test_bf16[gqa]",
            "outcome": "failed",
            "message": "",
        },
        {
            "test": "tests.launch.test_launcher::test_more_processes",
            "outcome": "skipped",
            "message": "",
        },
    ]


def test_the_verdict_counts_only_the_sections_asked_for():
    from tools.gpu_check.report import NOT_ASKED, verdict

    sections = {name: {"status": "skipped", "reason": NOT_ASKED} for name in SECTIONS}
    sections.update({name: {"status": "ok"} for name in QUICK_SECTIONS})
    assert verdict(sections, []).startswith(f"{len(QUICK_SECTIONS)}/{len(QUICK_SECTIONS)} ")
    sections["mfu"] = {"status": "timeout"}
    assert verdict(sections, []).startswith(f"{len(QUICK_SECTIONS) - 1}/{len(QUICK_SECTIONS)} ")


@pytest.mark.slow
def test_stack_dry_run_reports_its_sections(shakespeare, tmp_path):
    """--stack on the CPU: resume (same device and across, in fresh processes), DeepSpeed
    against Megatron, the planner's estimate beside each peak, selective recompute against
    none (FP8 refused: no GPU), TensorBoard and export; the
    multi-GPU section says why it does not run. gpu_tests is the correctness section's
    function (test_dry_run_reports_every_section), left out to save a pytest start."""
    from tools.gpu_check.plan import STACK_SECTIONS

    out = tmp_path / "report"
    asked = [name for name in STACK_SECTIONS if name != "gpu_tests"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.gpu_check.check",
            "--rehearse",
            "--stack",
            "--out",
            str(out),
            "--data",
            str(shakespeare),
            *[arg for name in asked for arg in ("--only", name)],
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "gpu-report.json").read_text())
    sections = report["sections"]
    assert list(sections) == list(STACK_SECTIONS)
    assert {name: s["status"] for name, s in sections.items()} == {
        "env": "ok",
        "gpu_tests": "skipped",
        "resume": "ok",
        "deepspeed": "ok",
        "memory": "ok",
        "options": "partial",  # FP8 needs a GPU with it
        "outputs": "ok",
        "multi_gpu": "skipped",
    }
    assert "need 2 or more" in sections["multi_gpu"]["reason"]

    resume = sections["resume"]["items"]
    settings = load_settings().stack
    assert [(i["variant"], i["kind"]) for i in resume] == [  # the dry run: the last variant
        (settings["resume"]["variants"][-1], kind)
        for kind in ("same device", "device -> cpu", "cpu -> device")
    ]
    assert all(i["status"] == "pass" and i["bitwise"] for i in resume)  # all on the CPU
    same = [i for i in resume if i["kind"] == "same device"]
    # load_seconds comes from the run's "loaded in 0.0s" line: a small checkpoint may load in 0.0
    assert all(
        i["checkpoint_mib"] > 0 and i["load_seconds"] >= 0 and set(i["saves"]) == {"1", "2"}
        for i in same
    )

    engines = sections["deepspeed"]["items"]
    assert [i["engine"] for i in engines] == ["megatron", "zero1"]  # the dry run: first stage
    assert all(i["status"] == "pass" for i in engines[1:]) and all(
        i["step_ms"] > 0 and i["memory_gib"] > 0 for i in engines
    )

    memory = sections["memory"]["items"]
    assert [i["name"] for i in memory] == settings["memory"]["variants"][:1]
    assert all(i["plan_gib"] > 0 and i["plan_verdict"] == "not measured" for i in memory)

    options = {i["name"]: i for i in sections["options"]["items"]}
    assert list(options) == ["baseline", *settings["options"]["choices"]]
    assert all(
        options[name]["status"] == "skipped" and "compute capability 8.9" in options[name]["reason"]
        for name in options
        if name.startswith("fp8")
    )
    recompute = options["selective recompute"]  # the same losses, recomputed
    assert recompute["status"] == "pass" and recompute["rel_diff"] < 1e-6, recompute
    assert recompute["step_ms_ratio"] > 0 and recompute["memory_gib_ratio"] > 0

    tensorboard, export = sections["outputs"]["items"]
    assert tensorboard["status"] == "pass" and not tensorboard["missing"]
    assert export["status"] == "pass", export
    assert export["t2train_generate"].startswith(settings["outputs"]["prompt"])
    verdicts = [t["verdict"] for t in report["targets"]]
    assert verdicts == ["not measured", "met", "met", "met", "not measured", "met", "met", "met"]


@pytest.mark.slow
def test_quality_dry_run_trains_the_comparison_into_the_output(shakespeare, tmp_path):
    """--quality's last section, rehearsed: the comparison's batch (two tiny runs in the dry
    run) trained in the check's worker, its records copied to OUT/records for the next window
    to resume from. (Its other sections are the full rehearsal's: test_dry_run_reports_every_
    section; --speed's too.)"""
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check.check", "--rehearse", "--quality"]
        + ["--out", str(out), "--data", str(shakespeare), "--only", "comparison"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    section = json.loads((out / "gpu-report.json").read_text())["sections"]["comparison"]
    assert section["status"] == "ok", section
    finished = sorted(item["name"] for item in section["items"])
    assert finished and finished == sorted(section["data"]["new"])
    for name in finished:  # what the next window resumes from
        assert (out / "records" / name / "metrics.jsonl").stat().st_size > 0


@pytest.mark.parametrize(
    "printed, selected",
    [
        ("collecting ... collected 2345 items / 2300 deselected / 45 selected\n", 45),
        ("collecting ... collected 12 items\n", 12),
        ("collected 1 item\n", 1),
        ("no header", None),
    ],
)
def test_gpu_tests_not_reached_are_counted_from_pytests_header(printed, selected):
    """The H200 run stopped pytest after 20 results, and nobody could tell how many GPU tests
    never ran: the count pytest printed before the first test is kept."""
    from tools.gpu_check.correctness import selected_count

    assert selected_count(printed) == selected
