"""The GPU check's report: targets judged, then each section, as Markdown and JSON."""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Callable, Optional

from t2train.bench.table import markdown_table
from tools.gpu_check import stack_report
from tools.gpu_check.plan import Plan, baseline

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
    "comparison": "GPU comparison (comparison.yaml)",
    **stack_report.TITLES,
}


# The sections' order in a report of the check (not --stack): the environment and the
# correctness first, then what was measured.
REPORT_ORDER = ("env", "correctness", "kernels", "step_cost", "mfu", "profile", "comparison")


def _table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table whose cells may hold any text (newlines, pipes)."""
    clean = [[str(cell).replace("\n", " ").replace("|", "\\|") for cell in row] for row in rows]
    return markdown_table(headers, clean)


def _items(section: Optional[dict], status: str = "ok") -> list[dict]:
    return [item for item in (section or {}).get("items", []) if item.get("status") == status]


def _judge(value: Optional[float], limit: Optional[float], at_most: bool) -> str:
    if value is None or limit is None:
        return "not measured"
    return "met" if (value <= limit if at_most else value >= limit) else "missed"


def kernel_rows(section: Optional[dict]) -> list[dict]:
    """Every timed row, also of the cases whose Triton kernel failed."""
    return [row for item in (section or {}).get("items", []) for row in item.get("rows", [])]


def reference_rows(section: Optional[dict]) -> list[dict]:
    return [item for item in _items(section) if item.get("reference")]


def strongest_reference(section: Optional[dict]) -> Optional[dict]:
    """The plain-PyTorch reference with the most tokens/s in this section (the compiled one,
    unless the eager one beat it)."""
    return max(reference_rows(section), key=lambda item: item["tokens_per_s"], default=None)


def baseline_row(section: Optional[dict], base: str) -> Optional[dict]:
    return next(
        (item for item in _items(section) if item["name"] == base and not item.get("reference")),
        None,
    )


def versus_reference(section: Optional[dict], base: str) -> Optional[dict]:
    """The baseline's tokens/s and peak memory as multiples of the strongest reference's in
    this section, over all their timed steps and per repeat (the k-th of each, where both were
    repeated), when both ran."""
    ours, theirs = baseline_row(section, base), strongest_reference(section)
    if not (ours and theirs):
        return None
    pairs = zip(ours.get("repeats") or [], theirs.get("repeats") or [])
    return {
        "reference": theirs["name"],
        "speed": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "speed_by_repeat": [their["step_ms"] / our["step_ms"] for our, their in pairs],
        "memory": ours["memory_gib"] / theirs["memory_gib"] if theirs["memory_gib"] else None,
    }


def _by_repeat(values: list[float]) -> str:
    return f" (repeats {min(values):.3f}-{max(values):.3f}x)" if len(values) > 1 else ""


def _reference_targets(plan: Plan, section: Optional[dict], name: str, preset: str) -> list[dict]:
    settings, base = plan.settings, baseline()
    versus = versus_reference(section, base) or {}
    speed, memory = versus.get("speed"), versus.get("memory")
    against = f" vs `{versus['reference']}`" if versus else ""
    return [
        {
            "target": f"{base} tokens/s >= {settings.reference_min_speed:.2f}x the strongest "
            f"plain-PyTorch reference ({preset})",
            "measured": f"{speed:.3f}x{against}{_by_repeat(versus['speed_by_repeat'])}"
            if speed
            else "",
            "verdict": _judge(speed, settings.reference_min_speed, at_most=False),
            "section": name,
        },
        {
            "target": f"{base} peak memory <= {settings.reference_max_memory:.2f}x that "
            f"reference's ({preset})",
            "measured": f"{memory:.3f}x{against}" if memory else "",
            "verdict": _judge(memory, settings.reference_max_memory, at_most=True),
            "section": name,
        },
    ]


def step_ratios(section: Optional[dict], baseline: str) -> dict:
    timed = {item["name"]: item for item in _items(section) if not item.get("reference")}
    base = timed.get(baseline)
    return {name: item["step_ms"] / base["step_ms"] for name, item in timed.items()} if base else {}


def _peaks(section: Optional[dict], env: Optional[dict]) -> tuple[Optional[float], Optional[float]]:
    """The data-sheet bf16 peak (the section's, else the environment's) and the measured
    matmul peak, in TFLOP/s."""
    env_data = (env or {}).get("data", {})
    sheet = (section or {}).get("data", {}).get("datasheet_tflops") or env_data.get(
        "datasheet_bf16_tflops"
    )
    return sheet, (env_data.get("matmul") or {}).get("tflops")


def mfu_numbers(section: Optional[dict], env: Optional[dict]) -> list[dict]:
    """Per timed run: TFLOP/s and MFU against the data sheet and the measured matmul peak, by
    t2train's causal count (``mfu``, ``mfu_measured``) and by 6N + 12*L*h*s (``mfu_6n``,
    ``mfu_6n_measured``; ``items.flop_counts``)."""
    data = (section or {}).get("data", {})
    sheet, measured = _peaks(section, env)

    def share(tflops: Optional[float], peak: Optional[float]) -> Optional[float]:
        return tflops / peak if tflops is not None and peak else None

    rows = []
    for item in _items(section):
        counts = {
            key: item.get(key, data.get(key)) for key in ("flops_per_token", "flops_per_token_6n")
        }
        tflops, tflops_6n = (
            item["tokens_per_s"] * flops / 1e12 if flops else None for flops in counts.values()
        )
        rows.append(
            dict(
                item,
                tflops=tflops,
                tflops_6n=tflops_6n,
                mfu=share(tflops, sheet),
                mfu_measured=share(tflops, measured),
                mfu_6n=share(tflops_6n, sheet),
                mfu_6n_measured=share(tflops_6n, measured),
            )
        )
    return rows


def _mfu_target(plan: Plan, sections: dict) -> dict:
    settings, base = plan.settings, baseline()
    ours = next(
        (
            row
            for row in mfu_numbers(sections.get("mfu"), sections.get("env"))
            if row["name"] == base and not row.get("reference")
        ),
        None,
    )
    mfu, mfu_6n = (ours["mfu"], ours["mfu_6n"]) if ours else (None, None)
    return {
        "target": f"{base} {plan.mfu_preset} MFU >= {settings.mfu_min:.0%} of the data-sheet "
        "peak, by the causal count",
        "measured": f"{mfu:.1%} (6N + 12Lhs: {_fmt(mfu_6n and 100 * mfu_6n)}%)"
        if mfu is not None
        else "",
        "verdict": _judge(mfu, settings.mfu_min, at_most=False),
        "section": "mfu",
    }


def _kernel_target(plan: Plan, sections: dict) -> dict:
    triton = [row for row in kernel_rows(sections.get("kernels")) if row["impl"] == "triton"]
    rows = [row for row in triton if row["vs_best_peer"] is not None]
    failed = [row for row in triton if row["ms"] is None]
    slowest = min(rows, key=lambda row: row["vs_best_peer"]) if rows else None
    minimum = plan.settings.kernel_min_vs_best_peer
    return {
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
        "section": "kernels",
    }


def evaluate_targets(plan: Plan, sections: dict) -> list[dict]:
    """Every target of this run's kind, judged met, missed or not measured; each names the
    section that measures it (a report lists those of its own sections only)."""
    if plan.stack:
        return stack_report.stack_targets(plan, sections)
    judged = _reference_targets(plan, sections.get("step_cost"), "step_cost", plan.step_preset)
    judged += _reference_targets(plan, sections.get("mfu"), "mfu", plan.mfu_preset)
    judged.append(_mfu_target(plan, sections))
    judged += [
        {
            "target": f"{row['variant']}: "
            + "; ".join(f"{check['what']} <= {check['limit_text']}" for check in row["checks"]),
            "measured": "; ".join(
                f"{check['what']} "
                + ("not measured" if check["value"] is None else f"{check['value']:.3f}")
                + ("" if check["verdict"] == "not measured" else f": {check['verdict']}")
                for check in row["checks"]
            ),
            "verdict": row["verdict"],
            "section": "step_cost",
        }
        for row in design_targets(plan, sections)
    ]
    judged.append(
        dict(
            stack_report.planner_target(plan, {"step_cost": sections.get("step_cost")}),
            section="step_cost",
        )
    )
    judged.append(_kernel_target(plan, sections))
    return [target for target in judged if target["section"] in plan.report_sections]


@functools.lru_cache(maxsize=64)
def _flops_at(preset: str, overrides: tuple, variant: str) -> Optional[float]:
    from t2train.bench.variants import variant_config
    from t2train.monitor.mfu import model_flops_per_token

    config = variant_config(preset, None, ["data.path=unused", *overrides], variant)
    vocab = config.model.vocab_size
    return model_flops_per_token(config.model, vocab) if vocab else None


def flop_ratio(plan: Plan, variant: str, timed: Optional[dict] = None) -> Optional[float]:
    """``variant``'s model FLOPs per token over the baseline's at the step shapes
    (t2train/model/flops.py): from the timed items where both recorded theirs, else from
    the configs (None without a configured vocabulary)."""
    timed = timed or {}
    mine, base = timed.get(variant) or {}, timed.get(baseline()) or {}
    if mine.get("flops_per_token") and base.get("flops_per_token"):
        return mine["flops_per_token"] / base["flops_per_token"]
    ours = _flops_at(plan.step_preset, tuple(plan.step_overrides), variant)
    theirs = _flops_at(plan.step_preset, tuple(plan.step_overrides), baseline())
    return ours / theirs if ours and theirs else None


def _verdict_of(verdicts: list[str]) -> str:
    if "missed" in verdicts:
        return "missed"
    return "not measured" if "not measured" in verdicts or not verdicts else "met"


def design_targets(plan: Plan, sections: dict) -> list[dict]:
    """Per variant other than the baseline, against the baseline of the same run: its step-time
    ratio at each preset (125m: step cost, 1b: MFU section), its FLOP ratio and time over
    FLOPs, its peak-memory ratio (125m), each judged against ``targets.yaml``'s ``designs``
    limits; every ``<design>+<mixer>`` without limits of its own against the design's ratio x
    the mixer's (``standard+shortswa``) x ``mixer.margin``."""
    from t2train.residual import registered
    from tools.gpu_check.plan import with_mixer

    settings, base = plan.settings, baseline()
    at_step, at_mfu = settings.step_preset, settings.mfu_preset
    section_of = {at_step: "step_cost", at_mfu: "mfu"}
    ratios = {preset: step_ratios(sections.get(section_of[preset]), base) for preset in section_of}
    timed = {
        item["name"]: item
        for item in _items(sections.get("step_cost"))
        if not item.get("reference")
    }
    base_memory = (timed.get(base) or {}).get("memory_gib")
    mixer = with_mixer(base)
    variants = list(settings.designs) + [
        with_mixer(design)
        for design in registered()
        if design != base and with_mixer(design) not in settings.designs
    ]
    rows = []
    for name in variants:
        limits = settings.designs.get(name, {})
        ratio = ratios[at_step].get(name)
        flops = flop_ratio(plan, name, timed)
        per_flop = ratio / flops if ratio and flops else None
        memory = timed[name]["memory_gib"] / base_memory if name in timed and base_memory else None
        checks = [
            (f"step time ({preset})", ratios.get(preset, {}).get(name), limit, f"{limit:.2f}x")
            for preset, limit in limits.get("step_time", {}).items()
        ]
        if "time_over_flops" in limits:
            limit = limits["time_over_flops"]
            checks.append((f"time / FLOPs ({at_step})", per_flop, limit, f"{limit:.2f}"))
        if name not in settings.designs:  # <design>+<mixer>: the product rule
            design = name.split("+")[0]
            alone = 1.0 if design == base else ratios[at_step].get(design)
            mixed = ratios[at_step].get(mixer)
            limit = alone * mixed * settings.mixer_margin if alone and mixed else None
            text = f"{design}'s x {mixer}'s x {settings.mixer_margin:g}" + (
                f" = {limit:.3f}x" if limit else ""
            )
            checks.append((f"step time ({at_step})", ratio, limit, text))
        if "peak_memory" in limits:
            limit = limits["peak_memory"]
            checks.append((f"peak memory ({at_step})", memory, limit, f"{limit:.2f}x"))
        judged = [
            {
                "what": what,
                "value": value,
                "limit": limit,
                "limit_text": text,
                "verdict": "not measured" if limit is None else _judge(value, limit, at_most=True),
            }
            for what, value, limit, text in checks
        ]
        rows.append(
            {
                "variant": name,
                "time_ratios": {preset: ratios[preset].get(name) for preset in section_of},
                "flop_ratio": flops,
                "time_over_flops": per_flop,
                "memory_ratio": memory,
                "checks": judged,
                "verdict": _verdict_of([check["verdict"] for check in judged]),
            }
        )
    return rows


def _design_md(rows: list[dict], plan: Plan, base: str) -> list[str]:
    at_step, at_mfu = plan.settings.step_preset, plan.settings.mfu_preset

    def cell(row, what_prefix: str, value) -> str:
        check = next((c for c in row["checks"] if c["what"].startswith(what_prefix)), None)
        limit = f" (<= {check['limit_text']})" if check else ""
        return _fmt(value, ".3f") + limit

    return (
        [
            "",
            f"## Design targets: against `{base}` of the same run",
            "",
            _table(
                [
                    "variant",
                    f"step time ratio ({at_step})",
                    f"step time ratio ({at_mfu})",
                    "FLOP ratio",
                    "time / FLOPs",
                    "memory ratio",
                    "verdict",
                ],
                [
                    [
                        row["variant"],
                        cell(row, f"step time ({at_step})", row["time_ratios"].get(at_step)),
                        cell(row, f"step time ({at_mfu})", row["time_ratios"].get(at_mfu)),
                        _fmt(row["flop_ratio"], ".3f"),
                        cell(row, "time / FLOPs", row["time_over_flops"]),
                        cell(row, "peak memory", row["memory_ratio"]),
                        row["verdict"],
                    ]
                    for row in rows
                ],
            ),
        ]
        if rows
        else []
    )


def headline(plan: Plan, sections: dict) -> list[dict]:
    """The baseline against the plain-PyTorch references at each preset: every row's median
    over all repeats, each repeat's median, their spread, MFU by both counts, and the
    baseline's speed and memory as multiples of the strongest reference's."""
    base, found = baseline(), []
    for name, preset in (("step_cost", plan.step_preset), ("mfu", plan.mfu_preset)):
        section = sections.get(name)
        numbers = {row["name"]: row for row in mfu_numbers(section, sections.get("env"))}
        rows = [
            numbers[item["name"]]
            for item in _items(section)
            if item.get("headline") or item.get("reference")
        ]
        if not rows:
            continue
        keep = (
            "name",
            "reference",
            "compiled",
            "step_ms",
            "tokens_per_s",
            "memory_gib",
            "warmup_s",
            "spread",
            "repeats_differ",
            "repeats_not_run",
            "repeats_failed",
            "mfu",
            "mfu_measured",
            "mfu_6n",
            "mfu_6n_measured",
        )
        found.append(
            {
                "section": name,
                "preset": preset,
                "versus": versus_reference(section, base),
                "max_spread": plan.settings.max_spread,
                "rows": [
                    {
                        **{key: row[key] for key in keep if key in row},
                        "repeats_ms": [repeat["step_ms"] for repeat in row.get("repeats") or []],
                    }
                    for row in rows
                ],
            }
        )
    return found


def _pair(first: Optional[float], second: Optional[float]) -> str:
    """Two shares as percentages, 'a / b'."""
    return " / ".join(_fmt(value and 100 * value) or "-" for value in (first, second))


def _headline_md(found: list[dict], base: str) -> list[str]:
    if not found:
        return []
    lines = [
        "",
        f"## Headline: `{base}` against the plain-PyTorch reference",
        "",
        "The baseline and the compiled reference (`t2train/bench/reference_gpt.py`: blocks and "
        "loss compiled, RoPE's tables built once, timed in a process of its own) in turns; "
        "step: the median of every timed step of all repeats; spread: the largest repeat's "
        "median over the smallest, less 1. MFU: of the data-sheet / of the measured matmul "
        "peak, by t2train's causal count and by 6N + 12*L*h*s.",
        "",
    ]
    rows, notes = [], []
    for block in found:
        versus = block["versus"] or {}
        for row in block["rows"]:
            ratio = (
                f"{versus['speed']:.3f}x"
                if row["name"] == base and not row.get("reference") and versus
                else "(strongest)"
                if row["name"] == versus.get("reference")
                else ""
            )
            spread = row.get("spread")
            rows.append(
                [
                    block["preset"],
                    row["name"],
                    f"{row['step_ms']:.1f}",
                    " / ".join(f"{ms:.1f}" for ms in row["repeats_ms"]),
                    (f"{100 * spread:.1f}%" if spread is not None else "")
                    + (f" (> {block['max_spread']:.0%})" if row.get("repeats_differ") else ""),
                    f"{row['tokens_per_s']:.0f}",
                    ratio,
                    f"{row['memory_gib']:.2f}",
                    _pair(row.get("mfu"), row.get("mfu_measured")),
                    _pair(row.get("mfu_6n"), row.get("mfu_6n_measured")),
                    _fmt(row.get("warmup_s")),
                ]
            )
            where = f"`{row['name']}` ({block['preset']})"
            if row.get("repeats_differ"):
                notes.append(
                    f"- {where}: its repeats differ by {100 * spread:.1f}% (more than "
                    f"{block['max_spread']:.0%}): "
                    + " / ".join(f"{ms:.1f}" for ms in row["repeats_ms"])
                    + " ms"
                )
            for reason in row.get("repeats_not_run", []):
                notes.append(f"- {where}: a repeat not run: {reason}")
            for reason in row.get("repeats_failed", []):
                notes.append(f"- {where}: a repeat failed: {reason}")
    lines.append(
        _table(
            [
                "preset",
                "run",
                "step (ms)",
                "repeats (ms)",
                "spread",
                "tokens/s",
                f"{base} vs strongest",
                "memory (GiB)",
                "MFU % causal",
                "MFU % 6N+12Lhs",
                "warm-up (s)",
            ],
            rows,
        )
    )
    return lines + ([""] + notes if notes else [])


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


def _step_md(section: dict, base: str, env: Optional[dict] = None) -> list[str]:
    data = section.get("data", {})
    ratios = step_ratios(section, base)
    rows = [
        [
            row["name"],
            f"{row['params'] / 1e6:.2f}",
            f"{row['step_ms']:.1f}",
            _fmt(ratios.get(row["name"]), ".3f"),
            _fmt(row.get("max_ratio"), ".2f"),
            f"{row['tokens_per_s']:.0f}",
            f"{row['memory_gib']:.2f}",
            _pair(row.get("mfu"), row.get("mfu_6n")),
            _fmt(row.get("warmup_s")),
        ]
        for row in mfu_numbers(section, env)
    ]
    repeats = data.get("repeats", 1)
    lines = [
        f"{data.get('preset')} preset {' '.join(data.get('overrides', ()))}; "
        f"{data.get('warmup')} warm-up + {data.get('steps')} timed steps of "
        f"{data.get('tokens_per_step')} tokens, median (the headline rows: of all "
        f"{repeats} repeats); warm-up: the untimed steps, compilation included (a "
        "reference's: in its own process); MFU: of the data-sheet peak, causal count / "
        "6N + 12*L*h*s; every step's time is in the JSON (`step_samples_ms`)",
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
                "MFU % causal / 6N",
                "warm-up (s)",
            ],
            rows,
        ),
    ]
    planned = [item for item in _items(section) if item.get("plan_gib")]
    if planned:
        lines += [
            "",
            "`t2train plan`'s per-GPU memory estimate beside the measured peak:",
            "",
            *stack_report.planner_md(planned, _table),
        ]
    return lines + _overhead_md(_items(section), base) + _problems_md(section)


def _problems_md(section: dict) -> list[str]:
    return _skipped_md(section) + [
        f"- error: {item.get('name')}: {item['reason']}" for item in _items(section, "error")
    ]


def _overhead_md(items: list[dict], base: str) -> list[str]:
    """t2train's baseline against each plain-PyTorch loop that ran beside it."""
    ours = next(
        (item for item in items if item["name"] == base and not item.get("reference")), None
    )
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
    ratios = step_ratios(section, baseline())
    rows = [
        [
            row["name"],
            f"{row['step_ms']:.1f}",
            _fmt(None if row.get("reference") else ratios.get(row["name"]), ".3f"),
            _fmt(row.get("max_ratio"), ".2f"),
            f"{row['tokens_per_s']:.0f}",
            _fmt(row["tflops"]),
            _pair(row["mfu"], row["mfu_measured"]),
            _fmt(row["tflops_6n"]),
            _pair(row["mfu_6n"], row["mfu_6n_measured"]),
            f"{row['memory_gib']:.2f}",
            _fmt(row.get("warmup_s")),
        ]
        for row in mfu_numbers(section, env)
    ]
    return (
        [
            f"{data.get('preset')} preset {' '.join(data.get('overrides', ()))}, "
            f"{data.get('precision')}, {data.get('warmup')} warm-up + {data.get('steps')} timed "
            f"steps (the headline rows: {data.get('repeats', 1)} repeats in turns); model "
            f"FLOPs per token of `{baseline()}`: {_fmt(data.get('flops_per_token'), '.3e')} by "
            "t2train's causal count (t2train/model/flops.py), "
            f"{_fmt(data.get('flops_per_token_6n'), '.3e')} by 6N + 12*L*h*s (full attention); "
            "MFU: of the data-sheet / of the measured matmul peak",
            "",
            _table(
                [
                    "run",
                    "step (ms)",
                    f"vs {baseline()}",
                    "target (at most)",
                    "tokens/s",
                    "TFLOP/s causal",
                    "MFU % causal",
                    "TFLOP/s 6N+12Lhs",
                    "MFU % 6N+12Lhs",
                    "memory (GiB)",
                    "warm-up (s)",
                ],
                rows,
            ),
        ]
        + _overhead_md(_items(section), baseline())
        + _problems_md(section)
    )


def _comparison_md(section: dict) -> list[str]:
    data = section.get("data", {})
    earlier, new = data.get("earlier", []), data.get("new", [])
    left = data.get("runs_in_batch", 0) - len(set(earlier) | set(new))
    lines = [
        f"`{data.get('batch')}` ({data.get('runs_in_batch')} runs, data "
        f"`{data.get('data')}`): {len(earlier)} finished in earlier windows "
        f"(`{data.get('records_from')}`), {len(new)} in this call"
        + (f" ({', '.join(new)})" if new else "")
        + f", {left} still to run; {_fmt(data.get('budget_s'), '.0f')} s given to training.",
        "",
        f"This call's records: `{data.get('records_to')}`. In the checkout: `python -m "
        "tools.gpu_check.compare --merge <those records>`, then commit "
        "`docs/results/compare-gpu/`; the next window continues from there.",
    ]
    if data.get("log_tail"):
        lines += ["", "```", *data["log_tail"], "```"]
    return lines + _problems_md(section)


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
        *_design_md(report.get("design_targets", []), plan, baseline()),
        *_headline_md(report.get("headline", []), baseline()),
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
                    str(plan.budgets.get(name, "")),
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
        "step_cost": lambda s: _step_md(s, baseline(), env),
        "mfu": lambda s: _mfu_md(s, env),
        "profile": lambda s: _profile_md(s, baseline()),
        "comparison": _comparison_md,
        **{name: _with_table(render) for name, render in stack_report.RENDERERS.items()},
    }
    order = (
        plan.report_sections
        if plan.stack
        else [name for name in REPORT_ORDER if name in plan.report_sections]
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
        "schema": 2,
        "dry_run": plan.dry_run,
        "date": datetime.date.today().isoformat(),
        "seconds": seconds,
        "verdict": verdict(sections, targets),
        "targets": targets,
        "budgets": plan.budgets,
        "sections": sections,
        "design_targets": [] if plan.stack else design_targets(plan, sections),
        "headline": [] if plan.stack else headline(plan, sections),
    }
    (out / "gpu-report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu-report.md").write_text(render_markdown(plan, sections, targets, report))
    return report


def _with_table(render: Callable[[dict, Callable], list[str]]) -> Callable[[dict], list[str]]:
    """A stack section's renderer with this report's table format."""
    return lambda section: render(section, _table)
