"""The --stack sections in the GPU check's report: their targets and their Markdown."""

from __future__ import annotations

from typing import Optional

from tools.gpu_check.plan import Plan

TITLES = {
    "gpu_tests": "GPU-marked tests",
    "resume": "Resume",
    "deepspeed": "DeepSpeed against the Megatron engine",
    "memory": "The planner's memory against the measured peak",
    "options": "FP8 and recompute against their defaults",
    "outputs": "TensorBoard and export",
    "multi_gpu": "Multi-GPU tests",
}


def _fmt(value, spec: str = ".1f") -> str:
    return "" if value is None else format(value, spec)


def _items(section: Optional[dict], *statuses: str) -> list[dict]:
    return [
        item
        for item in (section or {}).get("items", [])
        if not statuses or item.get("status") in statuses
    ]


def _verdict(items: list[dict]) -> str:
    """pass/fail items: met if every one passed, missed if any did not, else not measured."""
    if not items:
        return "not measured"
    return "met" if all(item.get("status") == "pass" for item in items) else "missed"


def planner_rows(sections: dict) -> list[dict]:
    """Every timed item with the planner's estimate beside it (step cost and memory)."""
    return [
        item
        for name in ("step_cost", "memory")
        for item in _items(sections.get(name), "ok")
        if item.get("plan_gib")
    ]


def planner_target(plan: Plan, sections: dict) -> dict:
    max_error = float(plan.settings.stack["memory"]["max_error"])
    rows = planner_rows(sections)
    judged = [row for row in rows if row.get("plan_verdict") in ("met", "missed")]
    worst = max(judged, key=lambda row: abs(row["plan_ratio"] - 1), default=None)
    return {
        "target": f"`t2train plan`'s per-GPU memory within {max_error:.0%} of the measured "
        "peak (each timed variant)",
        "measured": (
            f"{sum(r['plan_verdict'] == 'met' for r in judged)} of {len(judged)}; "
            f"worst {worst['name']} {worst['plan_ratio']:.2f}x"
            if worst
            else f"{len(rows)} estimated, none judged (no CUDA peak)"
            if rows
            else ""
        ),
        "verdict": ("missed" if any(r["plan_verdict"] == "missed" for r in judged) else "met")
        if judged
        else "not measured",
    }


def _tests_target(section: Optional[dict]) -> dict:
    tests = (section or {}).get("data", {}).get("gpu_tests") or {}
    counts = tests.get("counts", {})
    ran = sum(counts.get(k, 0) for k in ("passed", "failed", "error"))
    bad = counts.get("failed", 0) + counts.get("error", 0)
    unknown = counts.get("not reached")
    return {
        "target": "every GPU-marked test runs to completion and passes",
        "measured": (
            f"{counts.get('passed', 0)} passed, {bad} failed, "
            f"{counts.get('skipped', 0)} skipped, "
            f"{'?' if unknown is None else unknown} not reached"
        )
        if tests
        else "",
        "verdict": "not measured"
        if not tests or not ran
        else "met"
        if not bad and unknown == 0
        else "missed",
    }


def stack_targets(plan: Plan, sections: dict) -> list[dict]:
    resume = _items(sections.get("resume"))
    same = [item for item in resume if item.get("kind") == "same device"]
    across = [item for item in resume if item.get("kind") != "same device"]
    rtol = plan.settings.stack["resume"]["cross_device_rtol"]
    zero = [item for item in _items(sections.get("deepspeed")) if item.get("engine") != "megatron"]
    ds_rtol = plan.settings.stack["deepspeed"]["rtol"]
    outputs = {item.get("check"): item for item in _items(sections.get("outputs"))}
    return [
        _tests_target(sections.get("gpu_tests")),
        {
            "target": "a resumed run's losses identical to the uninterrupted run's (same device, "
            "fresh process, async save)",
            "measured": ", ".join(
                f"{i['variant']} {'bitwise' if i.get('bitwise') else 'differs'}" for i in same
            ),
            "verdict": _verdict(same),
        },
        {
            "target": f"a checkpoint resumes on the other device (GPU -> CPU, CPU -> GPU) within "
            f"{rtol:g} relative",
            "measured": ", ".join(
                f"{i['variant']} {i['kind']} {_fmt(i.get('max_rel_diff'), '.1e')}" for i in across
            ),
            "verdict": _verdict(across),
        },
        {
            "target": f"DeepSpeed ZeRO-1/2/3 losses within {ds_rtol:g} of the Megatron engine's",
            "measured": ", ".join(
                f"{i['variant']} {i['engine']} {_fmt(i.get('max_rel_diff'), '.1e')}" for i in zero
            ),
            "verdict": _verdict(zero),
        },
        planner_target(plan, sections),
        _options_target(plan, sections.get("options")),
        {
            "target": "TensorBoard's reader finds the expected tags of a GPU run",
            "measured": ", ".join(outputs["tensorboard"].get("missing", []))
            and "missing: " + ", ".join(outputs["tensorboard"]["missing"])
            if "tensorboard" in outputs
            else "",
            "verdict": _verdict([outputs["tensorboard"]] if "tensorboard" in outputs else []),
        },
        {
            "target": "the exported transformers folder generates (greedy) what `t2train "
            "generate` does",
            "measured": (
                f"first difference at character {outputs['export']['first_difference']}"
                if outputs.get("export", {}).get("first_difference") is not None
                else ""
            ),
            "verdict": _verdict([outputs["export"]] if "export" in outputs else []),
        },
    ]


def _options_target(plan: Plan, section: Optional[dict]) -> dict:
    settings = plan.settings.stack["options"]
    judged = [item for item in _items(section, "pass", "fail") if "rel_diff" in item]
    limits = ", ".join(f"{name} {choice['rtol']:g}" for name, choice in settings["choices"].items())
    return {
        "target": f"each option's loss (mean of the last {settings['mean_of_last']} of "
        f"{settings['steps']} steps) within its tolerance of the default run's: {limits}",
        "measured": ", ".join(
            f"{item['name']} {item['rel_diff']:.1e} (step "
            f"{_fmt(item.get('step_ms_ratio'), '.2f')}x, memory "
            f"{_fmt(item.get('memory_gib_ratio'), '.2f')}x)"
            for item in judged
        ),
        "verdict": _verdict(judged),
    }


def _table(table, headers: list[str], rows: list[list]) -> list[str]:
    return [table(headers, rows)] if rows else ["(nothing ran)"]


def _skipped(section: dict) -> list[str]:
    def label(item: dict) -> str:
        return str(item.get("variant") or item.get("name") or item.get("check"))

    return [
        "",
        *(
            f"- {item['status']}: {label(item)} {item.get('engine', '')} "
            f"({item.get('reason', '')[:300]})"
            for item in _items(section, "skipped", "error")
        ),
    ]


def _tests_md(section: dict, table) -> list[str]:
    tests = section.get("data", {}).get("gpu_tests")
    if not tests:
        return ["(no result)"]
    counts = ", ".join(f"{'?' if v is None else v} {k}" for k, v in tests["counts"].items())
    lines = [
        f'`pytest -m "{tests.get("marker")}" {" ".join(tests["paths"])}`: '
        f"{tests.get('selected')} selected; {counts} ({tests['seconds']:.0f}s); pytest: "
        f"{tests['summary']}",
        "",
    ]
    return (
        lines
        + [
            f"- {t['outcome']}: `{t['test']}` {t['message']}"
            for t in tests["not_passed"]
            if t["outcome"] != "skipped"
        ][:40]
    )


def _resume_md(section: dict, table) -> list[str]:
    data = section.get("data", {})
    rows = [
        [
            i["variant"],
            i["kind"],
            i["status"],
            "yes" if i.get("bitwise") else "no",
            _fmt(i.get("max_rel_diff"), ".1e"),
            _fmt(i.get("load_seconds")),
            _fmt(i.get("checkpoint_mib")),
            "; ".join(
                f"step {s}: {_fmt(v['save_s'], '.2f')}s, blocked {_fmt(v['blocked_s'], '.2f')}s"
                for s, v in i.get("saves", {}).items()
            ),
        ]
        for i in _items(section, "pass", "fail")
    ]
    processes = ", ".join(f"{k} {v:.0f}s" for k, v in data.get("processes", {}).items())
    return [
        f"{data.get('variants')}: {2 * data.get('steps_before_save', 0)} steps saving at "
        f"{data.get('steps_before_save')}, resumed in a fresh process; "
        f"{' '.join(data.get('overrides', ()))}; processes: {processes}",
        "",
        *_table(
            table,
            [
                "variant",
                "resume",
                "verdict",
                "bitwise",
                "max rel diff",
                "load (s)",
                "checkpoint (MiB)",
                "saves (async)",
            ],
            rows,
        ),
    ] + _skipped(section)


def _deepspeed_md(section: dict, table) -> list[str]:
    data = section.get("data", {})
    rows = [
        [
            i["variant"],
            i["engine"],
            i.get("status"),
            _fmt(i.get("max_rel_diff"), ".1e"),
            _fmt(i.get("step_ms")),
            _fmt(i.get("memory_gib"), ".2f"),
        ]
        for i in _items(section, "ok", "pass", "fail")
    ]
    return [
        f"{data.get('steps')} steps, {' '.join(data.get('overrides', ()))}; losses within "
        f"{data.get('rtol')} of the Megatron engine's at every step",
        "",
        *_table(
            table,
            [
                "variant",
                "engine",
                "verdict",
                "max rel diff",
                "step (ms, median)",
                "peak memory (GiB)",
            ],
            rows,
        ),
    ] + _skipped(section)


def planner_md(rows: list[dict], table) -> list[str]:
    return _table(
        table,
        ["variant", "preset", "measured peak (GiB)", "plan (GiB)", "measured / plan", "verdict"],
        [
            [
                r["name"],
                r.get("preset", ""),
                f"{r['memory_gib']:.2f}",
                f"{r['plan_gib']:.2f}",
                f"{r['plan_ratio']:.2f}",
                r["plan_verdict"],
            ]
            for r in rows
        ],
    )


def _memory_md(section: dict, table) -> list[str]:
    data = section.get("data", {})
    items = _items(section, "ok")
    return [
        f"{data.get('preset')} {' '.join(data.get('overrides', ()))}, then the step-cost "
        f"shapes; target |measured / plan - 1| <= {data.get('max_error')}",
        "",
        *planner_md([i for i in items if i.get("plan_gib")], table),
    ] + _skipped(section)


def _options_md(section: dict, table) -> list[str]:
    data = section.get("data", {})
    rows = [
        [
            i["name"],
            i.get("preset", ""),
            i.get("status"),
            _fmt(i.get("final_loss"), ".4f"),
            _fmt(i.get("rel_diff"), ".1e"),
            _fmt(i.get("step_ms")),
            _fmt(i.get("step_ms_ratio"), ".3f"),
            _fmt(i.get("memory_gib"), ".2f"),
            _fmt(i.get("memory_gib_ratio"), ".3f"),
        ]
        for i in _items(section, "ok", "pass", "fail")
    ]
    return [
        f"`{data.get('variant')}` at {data.get('preset')}, {data.get('steps')} steps, "
        f"{' '.join(data.get('overrides', ()))}; the loss compared is the mean of the last "
        f"{data.get('mean_of_last')} steps; ratios against the baseline of the same preset",
        "",
        *_table(
            table,
            [
                "option",
                "preset",
                "verdict",
                "final loss",
                "rel diff",
                "step (ms, median)",
                "step / baseline",
                "peak memory (GiB)",
                "memory / baseline",
            ],
            rows,
        ),
    ] + _skipped(section)


def _outputs_md(section: dict, table) -> list[str]:
    data = section.get("data", {})
    lines = [
        f"`{data.get('variant')}`, {data.get('steps')} steps, "
        f"{' '.join(data.get('overrides', ()))}",
        "",
    ]
    for item in section.get("items", []):
        if item.get("check") == "tensorboard":
            lines.append(
                f"- TensorBoard: {item['status']}; {item.get('scalars')} scalar tags, "
                f"images {item.get('images')}; missing {item.get('missing')}, "
                f"not finite {item.get('not_finite')}"
            )
        elif item.get("check") == "export" and "architecture" in item:
            lines.append(
                f"- export: {item['status']}; {item['architecture']} in "
                f"{item['export_s']:.1f}s; greedy on {item['device']}: t2train "
                f"{item['t2train_generate']}, transformers "
                f"{item['transformers_generate']}"
            )
        else:
            lines.append(f"- {item.get('check')}: {item.get('status')} {item.get('reason', '')}")
    return lines


RENDERERS = {
    "gpu_tests": _tests_md,
    "resume": _resume_md,
    "deepspeed": _deepspeed_md,
    "memory": _memory_md,
    "options": _options_md,
    "outputs": _outputs_md,
    "multi_gpu": _tests_md,
}
