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

from t2train.bench.gpu.plan import (
    QUICK_SECTIONS,
    SECTIONS,
    correctness_variants,
    load_settings,
    make_plan,
    mixer_variants,
    step_variants,
)
from t2train.bench.gpu.report import evaluate_targets
from t2train.bench.step import COMPILED_REFERENCE, REFERENCE
from t2train.residual import BASELINE, registered

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_reports_every_section(shakespeare, tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "t2train.bench.gpu.check",
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

    verdicts = {t["target"].split(" ")[0]: t["verdict"] for t in report["targets"]}
    assert len(report["targets"]) == 10 and set(verdicts.values()) <= {"met", "missed"} | {
        "not measured"
    }
    assert report["targets"][-1]["verdict"] == "not measured"  # no data-sheet peak on a CPU


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
            "t2train.bench.gpu.check",
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


def _step(name, step_ms, reference=False, memory=10.0):
    return {
        "name": name,
        "status": "ok",
        "step_ms": step_ms,
        "reference": reference,
        "tokens_per_s": 1000.0 / step_ms,
        "memory_gib": memory,
    }


def _compiled(step_ms, memory):
    return dict(_step(COMPILED_REFERENCE, step_ms, reference=True, memory=memory), compiled=True)


def test_targets_are_judged_from_the_sections():
    plan = make_plan(False, "unused")
    (first, limit1), (second, limit2), (third, _) = plan.settings.step_targets.items()
    sections = {
        "env": {"data": {"matmul": {"tflops": 800.0}}},
        "step_cost": {
            "items": [
                dict(_step(BASELINE, 100.0), plan_gib=9.0, plan_ratio=10 / 9, plan_verdict="met"),
                dict(
                    _step(first, 100.0 * limit1),
                    plan_gib=7.7,
                    plan_ratio=1.3,
                    plan_verdict="missed",
                ),
                _step(second, 100.0 * limit2 + 1.0),
                {"name": third, "status": "skipped", "reason": "time"},
                _step(REFERENCE, 90.0, reference=True, memory=5.0),
                _compiled(100.0, 10.0),
            ]
        },
        "kernels": {
            "items": [
                {
                    "status": "ok",
                    "rows": [
                        {
                            "kernel": "k",
                            "preset": "p",
                            "shape": "s",
                            "impl": "triton",
                            "ms": 1.0,
                            "vs_best_peer": v,
                        }
                        for v in (1.3, 0.9)
                    ],
                }
            ]
        },
        "mfu": {
            "data": {"flops_per_token": 1e10, "datasheet_tflops": 1000.0},
            "items": [
                dict(_step(BASELINE, 1.0), tokens_per_s=5e4),
                dict(_compiled(1.0, 9.0), tokens_per_s=5.1e4),
            ],
        },
    }
    verdicts = [t["verdict"] for t in evaluate_targets(plan, sections)]
    # 125m: as fast as the compiled loop (1.00x), same memory; 1b: slower (0.98x), more
    # memory (10 > 9 GiB); the planner: one variant 1.3x its estimate; the kernels: one 0.9x;
    # MFU 50% >= 50%.
    assert verdicts == [
        "met",
        "missed",
        "not measured",
        "met",
        "met",
        "missed",
        "missed",
        "missed",
        "missed",
        "met",
    ]
    planner = evaluate_targets(plan, sections)[7]
    assert "1 of 2; worst" in planner["measured"] and f"{first} 1.30x" in planner["measured"]
    sections["mfu"]["items"][0]["tokens_per_s"] = 4e4  # 40%
    assert evaluate_targets(plan, sections)[-1]["verdict"] == "missed"
    sections["mfu"]["items"].pop()  # no compiled loop at 1b: its two targets not measured
    assert [t["verdict"] for t in evaluate_targets(plan, sections)][5:7] == ["not measured"] * 2
    kernel_rows = sections["kernels"]["items"][0]["rows"]
    kernel_rows[1].update(vs_best_peer=1.1)
    assert evaluate_targets(plan, sections)[-2]["verdict"] == "met"
    kernel_rows.append(dict(kernel_rows[0], ms=None, vs_best_peer=None, error="CompileError"))
    judged = evaluate_targets(plan, sections)[-2]  # a kernel that does not run is not fast
    assert judged["verdict"] == "missed" and "1 failed to run" in judged["measured"]


def test_the_quick_plan_times_the_baseline_and_the_targets_within_four_minutes():
    plan = make_plan(False, "unused", quick=True)
    assert plan.sections == QUICK_SECTIONS and "profile" in QUICK_SECTIONS
    assert sum(plan.budgets[name] for name in plan.sections) <= 240
    assert step_variants(plan.settings, registered(), quick=True) == [
        BASELINE,
        *plan.settings.step_targets,
    ]
    assert mixer_variants(plan.settings, registered(), quick=True) == []
    full = make_plan(False, "unused")
    assert sum(full.budgets[name] for name in full.sections) <= 590  # one 10-minute command


def test_every_registered_design_is_timed_and_trained():
    settings = load_settings()
    alone, mixed = step_variants(settings, registered()), mixer_variants(settings, registered())
    assert alone[0] == BASELINE and set(settings.step_targets) <= set(alone)
    assert set(registered()) <= set(alone)
    assert sorted(alone + mixed) == sorted(set(alone + mixed))  # each once
    assert {name.split("+")[0] for name in alone + mixed if "+" in name} == set(registered())
    later = ("future_design",)
    assert "future_design" in step_variants(settings, registered() + later)
    assert "future_design" in correctness_variants(registered() + later)


def test_installer_keeps_what_is_installed_and_reports_what_fails(tmp_path):
    from t2train.bench.gpu import install as installer

    present = tmp_path / "PyYAML-0.0.1-py3-none-any.whl"  # installed here: must be kept
    broken = tmp_path / "t2train_no_such_dist-1.0-py3-none-any.whl"  # not a wheel: pip fails
    present.write_bytes(b"")
    broken.write_bytes(b"")
    kept, failed = installer.install_wheels([present, broken])
    assert kept.startswith("kept     pyyaml ") and "0.0.1" in kept
    assert failed.startswith("FAILED   t2train_no_such_dist-1.0")


def test_the_device_entry_point_names_its_one_argument(capsys):
    from t2train.bench.gpu.__main__ import main

    assert main([]) == 2
    assert "usage: python3 -m t2train.bench.gpu OUT_DIR" in capsys.readouterr().err


def test_a_failure_is_reported_with_what_locates_it(tmp_path):
    """The first GPU run reported a test as 'Tensor-likes are not close!' and a variant as
    'Triton Error [CUDA]: invalid argument', with nothing to tell by how much or where: the
    report keeps assert_close's numbers and the item's traceback."""
    import time

    from t2train.bench.gpu.check import Section
    from t2train.bench.gpu.correctness import _junit_items
    from t2train.bench.gpu.perf import _timed

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
    from t2train.bench.gpu.profile import kind_of

    assert kind_of(kernel) == kind


def test_gpu_tests_stopped_at_their_share_still_report_what_ran():
    """pytest writes its junit file only at the end; a run stopped at its time share (the
    second GPU run: 0 results from 62 s of tests) is read from its verbose lines."""
    from t2train.bench.gpu.correctness import _verbose_items

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
    from t2train.bench.gpu.report import NOT_ASKED, verdict

    sections = {name: {"status": "skipped", "reason": NOT_ASKED} for name in SECTIONS}
    sections.update({name: {"status": "ok"} for name in QUICK_SECTIONS})
    assert verdict(sections, []).startswith(f"{len(QUICK_SECTIONS)}/{len(QUICK_SECTIONS)} ")
    sections["mfu"] = {"status": "timeout"}
    assert verdict(sections, []).startswith(f"{len(QUICK_SECTIONS) - 1}/{len(QUICK_SECTIONS)} ")


@pytest.mark.slow
def test_stack_dry_run_reports_its_sections(shakespeare, tmp_path):
    """--stack on the CPU: resume (same device and across, in fresh processes), DeepSpeed
    against Megatron, the planner's estimate beside each peak, TensorBoard and export; the
    multi-GPU section says why it does not run. gpu_tests is the correctness section's
    function (test_dry_run_reports_every_section), left out to save a pytest start."""
    from t2train.bench.gpu.plan import STACK_SECTIONS

    out = tmp_path / "report"
    asked = [name for name in STACK_SECTIONS if name != "gpu_tests"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "t2train.bench.gpu.check",
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

    tensorboard, export = sections["outputs"]["items"]
    assert tensorboard["status"] == "pass" and not tensorboard["missing"]
    assert export["status"] == "pass", export
    assert export["t2train_generate"].startswith(settings["outputs"]["prompt"])
    verdicts = [t["verdict"] for t in report["targets"]]
    assert verdicts == ["not measured", "met", "met", "met", "not measured", "met", "met"]


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
    from t2train.bench.gpu.correctness import selected_count

    assert selected_count(printed) == selected
