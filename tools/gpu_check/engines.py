"""GPU check (--stack), deepspeed: ZeRO-1, -2 and -3 against the Megatron engine, as the CPU
suite compares them (tests/test_deepspeed_engine.py), on the GPU in bf16.

For each variant of ``stack.deepspeed`` (targets.yaml), the Megatron engine and then each ZeRO
stage train the same steps from the same seed on the same batches, in this process; each
stage's losses must stay within ``rtol`` (relative) of the Megatron engine's at every step.
Reported beside the losses: the median step time (steps after the first) and the peak memory
of each run. On one GPU data parallelism is 1, so ZeRO shards nothing: the memory differences
are each stage's own bookkeeping (tests/test_multi_gpu.py runs ZeRO across two GPUs).
"""

from __future__ import annotations

import statistics
import time

from tools.gpu_check.plan import Plan
from tools.gpu_check.runs import run_spec, scalars, train_run

MEGATRON = "megatron"


def engines(stages) -> dict[str, list[str]]:
    return {
        MEGATRON: ["train.engine=megatron"],
        **{
            f"zero{stage}": ["train.engine=deepspeed", f"deepspeed.zero_stage={stage}"]
            for stage in stages
        },
    }


def measured(result: dict) -> dict:
    """Median step time after the first step, and the run's peak memory (CUDA, else RSS)."""
    logged = scalars(result["run_dir"])
    steps = sorted(logged)
    times = [
        logged[step]["time/step_seconds"]
        for step in steps[1:] or steps
        if "time/step_seconds" in logged[step]
    ]
    last = logged[steps[-1]]
    return {
        "step_ms": statistics.median(times) * 1e3 if times else None,
        "memory_gib": last.get("memory/peak_allocated_gib", last.get("memory/rss_gib")),
    }


def compare(reference: dict, losses: dict, rtol: float) -> dict:
    worst = max(
        (abs(losses[s] - want) / abs(want) for s, want in reference.items() if s in losses),
        default=float("inf"),
    )
    ok = losses.keys() == reference.keys() and worst <= rtol
    return {"status": "pass" if ok else "fail", "max_rel_diff": worst, "rtol": rtol}


def run(section, plan: Plan) -> None:
    import torch

    settings = plan.settings.stack["deepspeed"]
    preset, overrides = plan.stack_run("deepspeed")
    rtol = float(settings["rtol"])
    section.data.update(overrides=overrides, steps=settings["steps"], rtol=rtol)
    # The dry run: the first variant and the first stage (tests/test_deepspeed_engine.py
    # compares every stage; here they differ by one setting, and ZeRO-3 takes 30x as long on
    # the CPU).
    variants, stages = settings["variants"], settings["stages"]
    if plan.dry_run:
        variants, stages = variants[:1], stages[:1]
    for variant in variants:
        reference = None
        for engine, choice in engines(stages).items():
            estimate = section.next_item_seconds(default=20.0)
            if not section.fits(estimate):
                section.add(
                    {
                        "variant": variant,
                        "engine": engine,
                        "status": "skipped",
                        "reason": section.no_time(estimate),
                    }
                )
                continue
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            started = time.monotonic()
            spec = run_spec(
                f"{variant} {engine}",
                preset,
                variant,
                [
                    f"data.path={plan.data}",
                    *overrides,
                    *choice,
                    f"train.steps={settings['steps']}",
                    "train.log_interval=1",
                    "train.eval_interval=100000",
                    "log.tensorboard=false",
                    "checkpoint.interval=100000",
                    "checkpoint.resume=none",
                    f"log.run_dir={section.scratch / variant.replace('+', '_') / engine}",
                ],
            )
            try:
                result = train_run(spec)
                item = dict(measured(result), losses=result["losses"], status="ok")
                if engine == MEGATRON:
                    reference = result["losses"]
                elif reference is not None:
                    item.update(compare(reference, result["losses"], rtol))
                else:
                    item.update(status="fail", reason="no Megatron-engine run to compare with")
            except Exception as err:  # reported; the other stages still run
                item = section.error(err)
            section.add(
                dict(item, variant=variant, engine=engine, seconds=time.monotonic() - started)
            )
