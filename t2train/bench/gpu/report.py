"""The GPU check's report: targets judged, then each section, as Markdown and JSON."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Callable, Optional

from t2train.bench.gpu import stack_report
from t2train.bench.gpu.plan import Plan, baseline
from t2train.bench.table import markdown_table

DRY_RUN_STAMP = (
    "**CPU dry run**: the whole plan at tiny shapes on the CPU (kernels under the "
    "Triton interpreter, bf16 training on the CPU). It proves the check runs; its "
    "timings and target verdicts mean nothing."
)
NOT_ASKED = "not asked for (--only, --quick)"  # the reason of a section this run leaves out
TITLES = {
    "env": "Environment",
    "correctness": "Correctness",
    "step_cost": "Step cost",
    "mfu": "MFU",
    "kernels": "Kernels",
    "profile": "Where the step time goes",
    **stack_report.TITLES,
}


def _table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table whose cells may hold any text (newlines, pipes)."""
    clean = [[str(cell).replace("\n", " ").replace("|", "\\|") for cell in row] for row in rows]
    return markdown_table(headers, clean)


def _items(section: Optional[dict], status: str = "ok") -> list[dict]:
    return [item for item in (section or {}).get("items", []) if item.get("status") == status]


def _judge(value: Optional[float], limit: float, at_most: bool) -> str:
    if value is None:
        return "not measured"
    return "met" if (value <= limit if at_most else value >= limit) else "missed"


def kernel_rows(section: Optional[dict]) -> list[dict]:
    """Every timed row, also of the cases whose Triton kernel failed."""
    return [row for item in (section or {}).get("items", []) for row in item.get("rows", [])]


def versus_compiled_reference(section: Optional[dict], base: str) -> Optional[dict]:
    """The baseline's tokens/s and peak memory as multiples of the compiled plain-PyTorch
    loop's, when both ran in this section."""
    items = _items(section)
    ours = next((item for item in items if item["name"] == base), None)
    theirs = next((item for item in items if item.get("compiled")), None)
    if not (ours and theirs):
        return None
    return {
        "speed": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "memory": ours["memory_gib"] / theirs["memory_gib"] if theirs["memory_gib"] else None,
    }


def _reference_targets(plan: Plan, section: Optional[dict], preset: str) -> list[dict]:
    settings, base = plan.settings, baseline()
    ratios = versus_compiled_reference(section, base) or {}
    speed, memory = ratios.get("speed"), ratios.get("memory")
    return [
        {
            "target": f"{base} tokens/s >= {settings.reference_min_speed:.2f}x the plain-PyTorch "
            f"loop with compiled blocks ({preset})",
            "measured": f"{speed:.3f}x" if speed else "",
            "verdict": _judge(speed, settings.reference_min_speed, at_most=False),
        },
        {
            "target": f"{base} peak memory <= {settings.reference_max_memory:.2f}x the compiled "
            f"loop's ({preset})",
            "measured": f"{memory:.3f}x" if memory else "",
            "verdict": _judge(memory, settings.reference_max_memory, at_most=True),
        },
    ]


def step_ratios(section: Optional[dict], baseline: str) -> dict:
    timed = {item["name"]: item for item in _items(section) if not item.get("reference")}
    base = timed.get(baseline)
    return {name: item["step_ms"] / base["step_ms"] for name, item in timed.items()} if base else {}


def mfu_numbers(section: Optional[dict], env: Optional[dict]) -> list[dict]:
    """Per timed run: TFLOP/s and MFU against the data sheet and the measured matmul peak."""
    data = (section or {}).get("data", {})
    measured = ((env or {}).get("data", {}).get("matmul") or {}).get("tflops")
    rows = []
    for item in _items(section):
        tflops = item["tokens_per_s"] * data["flops_per_token"] / 1e12
        sheet = data.get("datasheet_tflops")
        rows.append(
            dict(
                item,
                tflops=tflops,
                mfu=tflops / sheet if sheet else None,
                mfu_measured=tflops / measured if measured else None,
            )
        )
    return rows


def evaluate_targets(plan: Plan, sections: dict) -> list[dict]:
    if plan.stack:
        return stack_report.stack_targets(plan, sections)
    settings, base = plan.settings, baseline()
    ratios = step_ratios(sections.get("step_cost"), base)
    judged = []
    for variant, limit in settings.step_targets.items():
        ratio = ratios.get(variant)
        judged.append(
            {
                "target": f"{variant} step time <= {limit:.2f}x {base} ({plan.step_preset})",
                "measured": f"{ratio:.3f}x" if ratio else "",
                "verdict": _judge(ratio, limit, at_most=True),
            }
        )
    judged += _reference_targets(plan, sections.get("step_cost"), plan.step_preset)
    judged += _reference_targets(plan, sections.get("mfu"), plan.mfu_preset)
    judged.append(stack_report.planner_target(plan, {"step_cost": sections.get("step_cost")}))
    triton = [row for row in kernel_rows(sections.get("kernels")) if row["impl"] == "triton"]
    rows = [row for row in triton if row["vs_best_peer"] is not None]
    failed = [row for row in triton if row["ms"] is None]
    slowest = min(rows, key=lambda row: row["vs_best_peer"]) if rows else None
    minimum = settings.kernel_min_vs_best_peer
    judged.append(
        {
            "target": f"each Triton kernel >= {minimum:g}x the fastest of eager / torch.compile / "
            "FlexAttention (fwd+bwd)",
            "measured": "; ".join(
                (
                    [
                        f"{sum(r['vs_best_peer'] >= minimum for r in rows)} of {len(triton)}, "
                        "slowest "
                        f"{slowest['vs_best_peer']:.2f}x ({slowest['kernel']} {slowest['preset']} "
                        f"{slowest['shape']})"
                    ]
                    if slowest
                    else []
                )
                + ([f"{len(failed)} failed to run"] if failed else [])
            ),
            "verdict": "missed"
            if failed
            else _judge(slowest["vs_best_peer"] if slowest else None, minimum, at_most=False),
        }
    )
    runs = [
        row
        for row in mfu_numbers(sections.get("mfu"), sections.get("env"))
        if not row.get("reference")
    ]
    mfu = runs[0]["mfu"] if runs else None
    judged.append(
        {
            "target": f"{base} {plan.mfu_preset} MFU >= {settings.mfu_min:.0%} (data-sheet peak)",
            "measured": f"{mfu:.1%}" if mfu is not None else "",
            "verdict": _judge(mfu, settings.mfu_min, at_most=False),
        }
    )
    return judged


def flop_ratio(plan: Plan, variant: str) -> Optional[float]:
    """``variant``'s model FLOPs per token over the baseline's at the step shapes
    (t2train/model/flops.py); None without a configured vocabulary."""
    from t2train.bench.variants import variant_config
    from t2train.monitor.mfu import model_flops_per_token

    def flops(name: str) -> Optional[float]:
        config = variant_config(
            plan.step_preset, None, ["data.path=unused", *plan.step_overrides], name
        )
        vocab = config.model.vocab_size
        return model_flops_per_token(config.model, vocab) if vocab else None

    mine, base = flops(variant), flops(baseline())
    return mine / base if mine and base else None


def cost_targets(plan: Plan, sections: dict) -> list[dict]:
    """Issue 32, per timed variant: step time and peak memory against the baseline's, the
    FLOP ratio, time over FLOPs, and the verdict on every limit ``targets.yaml``'s ``cost``
    sets for it."""
    cost, base = plan.settings.cost, baseline()
    if not cost:
        return []
    timed = {
        item["name"]: item
        for item in _items(sections.get("step_cost"))
        if not item.get("reference")
    }
    ratios = step_ratios(sections.get("step_cost"), base)
    rows = []
    for name in [name for name in timed if name != base] + [
        name
        for name in {**cost.get("step_time", {}), **cost.get("peak_memory", {})}
        if name not in timed
    ]:
        item, ratio = timed.get(name), ratios.get(name)
        flops = flop_ratio(plan, name)
        memory = (
            item["memory_gib"] / timed[base]["memory_gib"]
            if item and base in timed and timed[base].get("memory_gib")
            else None
        )
        per_flop = ratio / flops if ratio and flops else None
        limits = [
            (per_flop, cost.get("max_time_over_flops")),
            (ratio, cost.get("step_time", {}).get(name)),
            (memory, cost.get("peak_memory", {}).get(name)),
        ]
        verdicts = [
            _judge(value, limit, at_most=True) for value, limit in limits if limit is not None
        ]
        rows.append(
            {
                "variant": name,
                "time_ratio": ratio,
                "flop_ratio": flops,
                "time_over_flops": per_flop,
                "memory_ratio": memory,
                "limits": {
                    "time_over_flops": limits[0][1],
                    "step_time": limits[1][1],
                    "peak_memory": limits[2][1],
                },
                "verdict": (
                    "missed"
                    if "missed" in verdicts
                    else "not measured"
                    if "not measured" in verdicts
                    else "met"
                ),
            }
        )
    return rows


def _cost_md(rows: list[dict], base: str) -> list[str]:
    def cell(value, limit, spec=".3f"):
        return _fmt(value, spec) + (f" (<= {limit:.2f})" if limit is not None else "")

    return (
        [
            "",
            f"## Cost targets (issue 32): against `{base}` of the same run",
            "",
            _table(
                [
                    "variant",
                    "step time ratio",
                    "FLOP ratio",
                    "time / FLOPs",
                    "memory ratio",
                    "verdict",
                ],
                [
                    [
                        row["variant"],
                        cell(row["time_ratio"], row["limits"]["step_time"]),
                        _fmt(row["flop_ratio"], ".3f"),
                        cell(row["time_over_flops"], row["limits"]["time_over_flops"]),
                        cell(row["memory_ratio"], row["limits"]["peak_memory"]),
                        row["verdict"],
                    ]
                    for row in rows
                ],
            ),
        ]
        if rows
        else []
    )


def _fmt(value, spec: str = ".1f") -> str:
    return "" if value is None else format(value, spec)


def _env_md(section: dict) -> list[str]:
    data = section.get("data", {})
    lines = [
        f"- device: {data.get('device', '?')}"
        + "".join(
            f", {key} {data[key]}"
            for key in ("driver", "cuda", "capability", "sms", "memory_gib")
            if key in data
        )
    ]
    versions = data.get("versions", {})
    lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    matmul = data.get("matmul") or {}
    if matmul:
        lines.append(
            f"- bf16 matmul {matmul['n']}^3: {matmul['tflops']:.1f} TFLOP/s measured; "
            f"data sheet {_fmt(data.get('datasheet_bf16_tflops')) or 'n/a'}"
        )
    if "copy_gbs" in data:
        lines.append(f"- device-to-device copy: {data['copy_gbs']:.0f} GB/s (read + write)")
    return lines


def _correctness_md(section: dict) -> list[str]:
    data, lines = section.get("data", {}), []
    tests = data.get("gpu_tests")
    if tests:
        counts = ", ".join(f"{'?' if v is None else v} {k}" for k, v in tests["counts"].items())
        lines += [
            f"GPU-marked tests (`pytest -m gpu {' '.join(tests['paths'])}`): {counts} "
            f"({tests['seconds']:.0f}s); pytest: {tests['summary']}",
            "",
        ]
        lines += [
            f"- {t['outcome']}: `{t['test']}` {t['message']}"
            for t in tests["not_passed"]
            if t["outcome"] != "skipped" or not tests["counts"].get("passed")
        ][:30]
    training = data.get("training")
    if training:
        lines += [
            "",
            f"bf16 training vs the fp32 CPU reference: {training['preset']} preset "
            f"{' '.join(training['overrides'])}, {training['steps']} steps, same initial "
            f"weights and batches; tolerance |bf16 - fp32| <= {training['rtol']:g} x "
            "fp32 at every step",
            "",
        ]
        rows = [
            [
                item["variant"],
                item["status"],
                _fmt(item.get("max_rel_diff"), ".1e"),
                " / ".join(
                    _fmt(x, ".4f")
                    for x in (item.get("reference") or [None])[-1:]
                    + (item.get("losses") or [None])[-1:]
                ),
                item.get("reason", "")[:200],
            ]
            for item in section.get("items", [])
        ]
        lines.append(
            _table(["variant", "verdict", "max rel diff", "last loss fp32 / bf16", "note"], rows)
        )
    return lines


def _kernels_md(section: dict) -> list[str]:
    from t2train.bench.kernel_cases import Row, table_cells

    data = section.get("data", {})
    rows = [table_cells(Row(**row)) for row in kernel_rows(section)]
    lines = [
        f"{data.get('mode', '')} in {data.get('dtype', '')}; vs best peer > 1: the "
        "Triton kernel is faster",
        "",
    ]
    lines.append(_table(data.get("header", []), rows) if rows else "(no case ran)")
    return lines + _skipped_md(section)


def _skipped_md(section: dict) -> list[str]:
    return [
        f"- skipped: {item.get('name') or item.get('variant') or item.get('kernel')} "
        f"{item.get('shape', '')} ({item['reason']})"
        for item in _items(section, "skipped")
    ]


def _step_md(section: dict, base: str) -> list[str]:
    data = section.get("data", {})
    ratios = step_ratios(section, base)
    items = _items(section)
    rows = [
        [
            item["name"],
            f"{item['params'] / 1e6:.2f}",
            f"{item['step_ms']:.1f}",
            _fmt(ratios.get(item["name"]), ".3f"),
            _fmt(item.get("max_ratio"), ".2f"),
            f"{item['tokens_per_s']:.0f}",
            f"{item['memory_gib']:.2f}",
            _fmt(item.get("warmup_s")),
        ]
        for item in items
    ]
    lines = [
        f"{data.get('preset')} preset {' '.join(data.get('overrides', ()))}; "
        f"{data.get('warmup')} warm-up + {data.get('steps')} timed steps of "
        f"{data.get('tokens_per_step')} tokens, median; warm-up: the untimed steps, "
        "compilation included",
        "",
        _table(
            [
                "variant",
                "params (M)",
                "step (ms)",
                "vs " + base,
                "target (at most)",
                "tokens/s",
                "memory (GiB)",
                "warm-up (s)",
            ],
            rows,
        ),
    ]
    planned = [item for item in items if item.get("plan_gib")]
    if planned:
        lines += [
            "",
            "`t2train plan`'s per-GPU memory estimate beside the measured peak:",
            "",
            *stack_report.planner_md(planned, _table),
        ]
    return lines + _overhead_md(items, base) + _skipped_md(section)


def _overhead_md(items: list[dict], base: str) -> list[str]:
    """t2train's baseline against each plain-PyTorch loop that ran beside it."""
    ours = next((item for item in items if item["name"] == base), None)
    lines = []
    for reference in (item for item in items if item.get("reference")):
        if ours:
            speed = ours["tokens_per_s"] / reference["tokens_per_s"]
            memory = ours["memory_gib"] / reference["memory_gib"]
            lines.append(
                f"- t2train `{base}` runs at {speed:.2f}x the tokens/s and "
                f"{memory:.2f}x the peak memory of `{reference['name']}`"
            )
    return [""] + lines if lines else []


def _mfu_md(section: dict, env: Optional[dict]) -> list[str]:
    data = section.get("data", {})
    rows = [
        [
            row["name"],
            f"{row['step_ms']:.1f}",
            f"{row['tokens_per_s']:.0f}",
            f"{row['tflops']:.1f}",
            _fmt(row["mfu"] and 100 * row["mfu"]),
            _fmt(row["mfu_measured"] and 100 * row["mfu_measured"]),
            f"{row['memory_gib']:.2f}",
            _fmt(row.get("warmup_s")),
        ]
        for row in mfu_numbers(section, env)
    ]
    return (
        [
            f"{data.get('preset')} preset {' '.join(data.get('overrides', ()))}, "
            f"{data.get('precision')}, {data.get('warmup')} warm-up + {data.get('steps')} timed "
            f"steps; {_fmt(data.get('flops_per_token'), '.3e')} model FLOPs per token",
            "",
            _table(
                [
                    "run",
                    "step (ms)",
                    "tokens/s",
                    "TFLOP/s",
                    "MFU % (data sheet)",
                    "MFU % (measured matmul peak)",
                    "memory (GiB)",
                    "warm-up (s)",
                ],
                rows,
            ),
        ]
        + _overhead_md(_items(section), baseline())
        + _skipped_md(section)
    )


def _profile_md(section: dict, base: str) -> list[str]:
    data = section.get("data", {})
    items = _items(section)
    kinds = list(dict.fromkeys(kind for item in items for kind in item["kinds"]))
    base_item = next((item for item in items if item["name"] == base), None)
    rows = [
        [
            item["name"],
            f"{item['ms_per_step']:.1f}",
            _fmt(base_item and item["ms_per_step"] - base_item["ms_per_step"], "+.1f"),
            *[_fmt(item["kinds"].get(kind), ".1f") for kind in kinds],
        ]
        for item in items
    ]
    lines = [
        f"{data.get('preset')} preset, {data.get('steps')} profiled steps after "
        f"{data.get('warmup')} warm-up; milliseconds per step of kernel time "
        "(`torch.profiler`; on the CPU dry run, operators' self CPU time) by kind",
        "",
        _table(["variant", "total", f"vs {base}", *kinds], rows),
    ]
    for item in items:
        lines += ["", f"`{item['name']}`, heaviest:", ""]
        lines.append(
            _table(
                ["kernel", "kind", "ms per step", "share"],
                [
                    [top["kernel"][:90], top["kind"], f"{top['ms']:.2f}", f"{top['share']:.0%}"]
                    for top in item["top"]
                ],
            )
        )
    return (
        lines
        + _skipped_md(section)
        + [f"- error: {item['name']}: {item['reason']}" for item in _items(section, "error")]
    )


def render_markdown(plan: Plan, sections: dict, targets: list[dict], report: dict) -> str:
    env = sections.get("env") or {}
    device = env.get("data", {}).get("device", "unknown device")
    lines = [f"# t2train GPU check: {device}, {report['date']}", ""]
    if plan.dry_run:
        lines += [DRY_RUN_STAMP, ""]
    lines += [
        f"Verdict: {report['verdict']}. Total {report['seconds']:.0f}s.",
        "",
        "## Targets",
        "",
        _table(
            ["target", "measured", "verdict"],
            [[t["target"], t["measured"], t["verdict"]] for t in targets],
        ),
        *_cost_md(report.get("cost_targets", []), baseline()),
        "",
        "## Sections",
        "",
        _table(
            ["section", "status", "seconds", "budget (s)", "note"],
            [
                [
                    name,
                    (sections.get(name) or {}).get("status", "missing"),
                    _fmt((sections.get(name) or {}).get("seconds"), ".0f"),
                    str(plan.budgets[name]),
                    (sections.get(name) or {}).get("reason", "")[:300],
                ]
                for name in plan.report_sections
            ],
        ),
    ]
    renderers = {
        "env": _env_md,
        "correctness": _correctness_md,
        "kernels": _kernels_md,
        "step_cost": lambda s: _step_md(s, baseline()),
        "mfu": lambda s: _mfu_md(s, env),
        "profile": lambda s: _profile_md(s, baseline()),
        **{name: _with_table(render) for name, render in stack_report.RENDERERS.items()},
    }
    order = (
        plan.report_sections
        if plan.stack
        else ("env", "correctness", "kernels", "step_cost", "mfu", "profile")
    )
    for name in order:
        section = sections.get(name)
        lines += ["", f"## {TITLES[name]}", ""]
        if not section or section.get("status") in ("skipped", "missing"):
            lines.append(f"Not run: {(section or {}).get('reason', 'no result')}")
            continue
        lines += renderers[name](section)
        if section.get("traceback"):
            lines += ["", "```", section["traceback"].strip(), "```"]
    return "\n".join(lines) + "\n"


def verdict(sections: dict, targets: list[dict]) -> str:
    asked = [name for name in sections if (sections.get(name) or {}).get("reason") != NOT_ASKED]
    statuses = [(sections.get(name) or {}).get("status", "missing") for name in asked]
    complete = sum(status == "ok" for status in statuses)
    not_here = sum(status == "skipped" for status in statuses)  # does not apply (one GPU)
    failing = [
        item["variant"]
        for item in (sections.get("correctness") or {}).get("items", [])
        if item.get("status") in ("fail", "error")
    ]
    tested = sections.get("correctness") or sections.get("gpu_tests") or {}
    tests = tested.get("data", {}).get("gpu_tests") or {}
    failed_tests = sum(tests.get("counts", {}).get(k, 0) for k in ("failed", "error"))
    met = sum(t["verdict"] == "met" for t in targets)
    training = (
        ""
        if "correctness" not in sections
        else ", bf16 training "
        + (f"off for {', '.join(failing)}" if failing else "within tolerance where run")
    )
    return (
        f"{complete}/{len(asked)} sections complete"
        f"{f' ({not_here} not applicable here)' if not_here else ''}; "
        f"{failed_tests} GPU test(s) failed{training}; targets: {met}/{len(targets)} met"
    )


def write_report(plan: Plan, sections: dict, out: Path, seconds: float) -> dict:
    targets = evaluate_targets(plan, sections)
    report = {
        "schema": 1,
        "dry_run": plan.dry_run,
        "date": datetime.date.today().isoformat(),
        "seconds": seconds,
        "verdict": verdict(sections, targets),
        "targets": targets,
        "budgets": plan.budgets,
        "sections": sections,
        "cost_targets": cost_targets(plan, sections),
    }
    (out / "gpu-report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu-report.md").write_text(render_markdown(plan, sections, targets, report))
    return report


def _with_table(render: Callable[[dict, Callable], list[str]]) -> Callable[[dict], list[str]]:
    """A stack section's renderer with this report's table format."""
    return lambda section: render(section, _table)
