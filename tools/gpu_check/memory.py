"""GPU check, the planner against reality: ``t2train plan``'s per-GPU memory estimate beside the
peak a step measured.

``plan_gib`` gives the estimate of one GPU (the only one: TP = PP = DP = 1) for a variant's
config; the step-cost section puts it next to each variant it times, and the --stack
``memory`` section times the 350m preset's step once, then the ``stack.memory.step_variants``
of targets.yaml at the step-cost shapes while time lasts. The target: measured / estimated
within ``stack.memory.max_error`` of 1. On the CPU the measured figure is the process RSS, not
a device peak, so nothing is judged there (the dry run checks the plumbing).
"""

from __future__ import annotations

import time

from tools.gpu_check.plan import Plan

GIB = 2**30


def plan_gib(config, vocab_size: int) -> float:
    """The planner's estimate for this config on one GPU, in GiB."""
    from t2train.bench.plan import plan_layout

    (stage,) = plan_layout(config, vocab_size, world_size=1).stages
    return stage.total_bytes / GIB


def judged(measured_gib: float, estimate_gib: float, max_error: float) -> dict:
    """Fields of a timed item: the estimate, the ratio and its verdict (only on a GPU)."""
    import torch

    ratio = measured_gib / estimate_gib
    return {
        "plan_gib": estimate_gib,
        "plan_ratio": ratio,
        "plan_verdict": (
            ("met" if abs(ratio - 1) <= max_error else "missed")
            if torch.cuda.is_available()
            else "not measured"
        ),
    }


def run(section, plan: Plan) -> None:
    from t2train.bench.step import model_vocab_size, real_batches, time_design
    from tools.gpu_check.items import timing_item, variant_config

    settings = plan.settings.stack["memory"]
    max_error = float(settings["max_error"])
    preset, overrides = plan.stack_run("memory")
    section.data.update(
        preset=preset,
        overrides=overrides,
        max_error=max_error,
        step_preset=plan.step_preset,
        step_overrides=plan.step_overrides,
    )
    shapes = plan.items(
        [(preset, overrides, name) for name in settings["variants"]]
        + [(plan.step_preset, plan.step_overrides, name) for name in settings["step_variants"]]
    )
    batches = {}
    for at, extra, name in shapes:
        config = variant_config(plan, at, extra, name)
        vocab = model_vocab_size(config)
        estimate = section.next_item_seconds(default=40.0)
        if not section.fits(estimate):
            section.add(
                {
                    "name": name,
                    "preset": at,
                    "status": "skipped",
                    "reason": section.no_time(estimate),
                }
            )
            continue
        started = time.monotonic()
        try:
            if at not in batches:
                batches[at] = real_batches(config, plan.step_warmup + 2)
            timing = time_design(config, vocab, batches[at], plan.step_warmup, name)
            item = dict(
                timing_item(name, timing),
                status="ok",
                **judged(timing.memory_gib, plan_gib(config, vocab), max_error),
            )
        except Exception as err:  # reported; the next variant still runs
            item = dict(section.error(err), name=name)
        section.add(dict(item, preset=at, seconds=time.monotonic() - started))
