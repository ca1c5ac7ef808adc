"""GPU check (--stack), options: the training options a user turns on for speed or memory,
against the same run without them, on the same seed and batches.

``stack.options`` (targets.yaml) lists them: FP8 GEMMs (``train.precision=fp8``, each of
torchao's recipes) against bf16, selective and full activation recompute against none. Each
trains ``steps`` steps at the section's preset and shape; its loss (the mean of the last
``mean_of_last`` steps) must be within the option's ``rtol`` (relative) of the baseline's, and
its median step time and peak memory are reported as ratios to the baseline's. Then, while
time lasts, the options of ``large.options`` against the baseline at the ``large`` preset,
for the step time and memory only (a few steps). On a GPU without FP8, and in the CPU dry run,
the trainer refuses the FP8 options in one line: recorded as skipped, with that line.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

from t2train.errors import ConfigError
from tools.gpu_check.engines import measured
from tools.gpu_check.plan import Plan
from tools.gpu_check.runs import run_spec, train_run

BASELINE = "baseline"
FP8_REFUSED = "train.precision='fp8'"  # how the trainer's refusal on a GPU without FP8 begins


def final_loss(losses: dict, last: int) -> float:
    """The mean loss of the last ``last`` steps (one step's loss is noise)."""
    steps = sorted(losses, key=int)[-last:]
    return statistics.fmean(losses[step] for step in steps)


def ratios(item: dict, baseline: dict) -> dict:
    """Step time and peak memory of ``item`` over the baseline's."""
    return {
        f"{what}_ratio": item[what] / baseline[what]
        for what in ("step_ms", "memory_gib")
        if item.get(what) and baseline.get(what)
    }


def judged(item: dict, baseline: dict, rtol: float, last: int) -> dict:
    """``item`` against the baseline's run: its final loss within ``rtol``, and its ratios."""
    loss, want = final_loss(item["losses"], last), final_loss(baseline["losses"], last)
    difference = abs(loss - want) / abs(want)
    return dict(
        item,
        **ratios(item, baseline),
        final_loss=loss,
        rel_diff=difference,
        rtol=rtol,
        status="pass" if difference <= rtol else "fail",
    )


def run(section, plan: Plan) -> None:
    settings = plan.settings.stack["options"]
    preset, overrides = plan.stack_run("options")
    steps, last = int(settings["steps"]), int(settings["mean_of_last"])
    choices = settings["choices"]
    large = settings["large"]
    if plan.dry_run:  # a few steps of the tiny model: the section's code, not its numbers
        steps, last, overrides = 3, 2, (*overrides, "train.warmup_steps=1")
    section.data.update(
        preset=preset,
        overrides=overrides,
        steps=steps,
        mean_of_last=last,
        variant=settings["variant"],
    )
    runs = [(preset, name, steps) for name in [BASELINE, *choices]]
    if not plan.dry_run:
        runs += [(large["preset"], name, large["steps"]) for name in [BASELINE, *large["options"]]]
    baselines: dict[str, Optional[dict]] = {}
    for at, name, count in runs:
        estimate = section.next_item_seconds(default=60.0)
        label = {"name": name, "preset": at}
        if not section.fits(estimate):
            section.add(dict(label, status="skipped", reason=section.no_time(estimate)))
            continue
        shape = overrides if at == preset else (*large["shape"], *settings["overrides"])
        chosen = [] if name == BASELINE else choices[name]["set"]
        started = time.monotonic()
        try:
            item = _train(section, plan, at, name, [*shape, *chosen], count)
        except Exception as err:  # reported; the other options still run
            if isinstance(err, ConfigError) and str(err).startswith(FP8_REFUSED):
                section.add(dict(label, status="skipped", reason=str(err)))  # no FP8 here
            else:
                section.add(dict(label, **section.error(err), seconds=time.monotonic() - started))
            continue
        baseline = baselines.get(at)
        if name == BASELINE:
            baselines[at] = item
            item = dict(item, final_loss=final_loss(item["losses"], last), status="ok")
        elif baseline is None:
            item = dict(item, status="fail", reason="its baseline did not run")
        elif at == preset:
            item = judged(item, baseline, float(choices[name]["rtol"]), last)
        else:
            item = dict(item, **ratios(item, baseline), status="ok")
        section.add(dict(item, **label, seconds=time.monotonic() - started))


def _train(section, plan: Plan, preset: str, name: str, overrides: list, steps: int) -> dict:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    settings = plan.settings.stack["options"]
    spec = run_spec(
        name,
        preset,
        settings["variant"],
        [
            f"data.path={plan.data}",
            *overrides,
            f"train.steps={steps}",
            "train.log_interval=1",
            "train.eval_interval=100000",
            "log.tensorboard=false",
            "checkpoint.interval=100000",
            "checkpoint.resume=none",
            f"log.run_dir={section.scratch / preset / name.replace(' ', '_')}",
        ],
    )
    result = train_run(spec)
    return dict(measured(result), losses=result["losses"])
