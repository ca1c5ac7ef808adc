"""GPU check (--stack), resume: stop, resume from the sharded checkpoint in a fresh process,
and continue as if the run had never stopped; on the same device and across devices.

Three processes, each training every variant of ``stack.resume`` (targets.yaml) in bf16 with
async saves:

1. on the GPU, 2N steps from scratch, saving at N and 2N (the uninterrupted runs);
2. on the CPU: each GPU checkpoint of step N resumed to 2N, and 2N steps from scratch saving
   at N (a CPU checkpoint for the GPU);
3. on the GPU, a fresh process: each GPU checkpoint of step N resumed to 2N (losses identical
   to process 1's: same device, same kernels), and each CPU checkpoint of step N resumed to 2N
   (within ``cross_device_rtol`` of process 2's).

Identical losses are asked of the same device. The kernels are run-to-run deterministic on
one GPU unless one accumulates with atomics (then the report shows the largest difference);
across devices the bf16 kernels round differently, so the tolerance is the correctness
section's. In the CPU dry run every process runs on the CPU (the same code, CPU to CPU), and
processes 2 and 3 are one.
"""

from __future__ import annotations

import time
from pathlib import Path

from tools.gpu_check.plan import Plan
from tools.gpu_check.runs import run_spec, scalars, size_mib, train_in_process

SAVE_SECONDS, BLOCKED_SECONDS = "checkpoint/save_seconds", "checkpoint/blocked_seconds"


def checkpoint_dir(run_dir: str, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def _variants(plan: Plan) -> list[str]:
    """The dry run: the last variant only (the multi-stream one; the first is the same code
    path, and tests/test_resume.py resumes every design bitwise)."""
    variants = plan.settings.stack["resume"]["variants"]
    return variants[-1:] if plan.dry_run else variants


def _specs(plan: Plan, root: Path, n: int, label: str, resume_from: dict | None = None) -> list:
    """One run per variant, ``label`` in its name; from scratch, or resuming ``resume_from``
    (variant -> its step-N checkpoint)."""
    preset, overrides = plan.stack_run("resume")
    specs = []
    for variant in _variants(plan):
        start = (
            f"checkpoint.resume={resume_from[variant]}" if resume_from else "checkpoint.resume=none"
        )
        specs.append(
            run_spec(
                f"{variant} {label}",
                preset,
                variant,
                [
                    f"data.path={plan.data}",
                    *overrides,
                    f"train.steps={2 * n}",
                    f"checkpoint.interval={n}",
                    "train.eval_interval=100000",
                    f"log.run_dir={root / label / variant.replace('+', '_')}",
                    start,
                    *["train.warmup_steps=0"] * plan.dry_run,
                ],
            )
        )  # the dry run's 2 steps
    return specs


def _compare(straight: dict, resumed: dict, n: int, rtol: float | None) -> dict:
    """Steps N+1..2N of the uninterrupted run against the resumed one's: identical
    (``rtol`` None) or within ``rtol`` relative."""
    tail = {step: loss for step, loss in straight["losses"].items() if int(step) > n}
    got = resumed["losses"]
    worst = max(
        (abs(got[s] - want) / abs(want) for s, want in tail.items() if s in got),
        default=float("inf"),
    )
    same_steps = sorted(got, key=int) == sorted(tail, key=int)
    bitwise = same_steps and all(got[s] == tail[s] for s in tail)
    ok = bitwise if rtol is None else same_steps and worst <= rtol
    return {
        "status": "pass" if ok else "fail",
        "bitwise": bitwise,
        "max_rel_diff": worst,
        "rtol": rtol,
        "expected": tail,
        "losses": got,
        "load_seconds": resumed["load_seconds"],
        "device": resumed["device"],
    }


def _checkpoint_facts(run: dict, n: int) -> dict:
    """Size of the step-N checkpoint, and each save's time (total and training blocked)."""
    logged = scalars(Path(run["run_dir"]))
    saves = {
        step: {
            "save_s": logged[step].get(SAVE_SECONDS),
            "blocked_s": logged[step].get(BLOCKED_SECONDS),
        }
        for step in (n, 2 * n)
        if step in logged
    }
    return {"checkpoint_mib": size_mib(checkpoint_dir(run["run_dir"], n)), "saves": saves}


def run(section, plan: Plan) -> None:
    settings = plan.settings.stack["resume"]
    # The dry run: one step each side of the save (plumbing: 5 tiny runs in 2 processes).
    n = 1 if plan.dry_run else settings["steps_before_save"]
    rtol = float(settings["cross_device_rtol"])
    root = section.scratch
    section.data.update(
        variants=_variants(plan),
        steps_before_save=n,
        cross_device_rtol=rtol,
        overrides=plan.stack_run("resume")[1],
    )

    def process(label: str, specs: list, cpu: bool = False) -> dict:
        started = time.monotonic()
        result = train_in_process(specs, root, label, section.left(), cpu=cpu)
        section.data.setdefault("processes", {})[label] = time.monotonic() - started
        section.save()
        return result

    straight = process("device", _specs(plan, root, n, "straight"))
    on_device = {
        variant: checkpoint_dir(straight[f"{variant} straight"]["run_dir"], n)
        for variant in _variants(plan)
    }
    on_cpu = {
        variant: checkpoint_dir(root / "cpu-straight" / variant.replace("+", "_"), n)
        for variant in _variants(plan)
    }
    cpu_runs = _specs(plan, root, n, "device-to-cpu", on_device) + _specs(
        plan, root, n, "cpu-straight"
    )
    resume_runs = _specs(plan, root, n, "resumed", on_device) + _specs(
        plan, root, n, "cpu-to-device", on_cpu
    )
    if plan.dry_run:  # every process is on the CPU: one fresh process does both (13 s less)
        resumed = cpu = process("device-resume", cpu_runs + resume_runs)
    else:
        cpu = process("cpu", cpu_runs, cpu=True)
        resumed = process("device-resume", resume_runs)
    for variant in _variants(plan):
        reference = straight[f"{variant} straight"]
        facts = _checkpoint_facts(reference, n)
        for kind, got, want, tolerance in (
            ("same device", resumed[f"{variant} resumed"], reference, None),
            ("device -> cpu", cpu[f"{variant} device-to-cpu"], reference, rtol),
            (
                "cpu -> device",
                resumed[f"{variant} cpu-to-device"],
                cpu[f"{variant} cpu-straight"],
                rtol,
            ),
        ):
            section.add(
                dict(
                    _compare(want, got, n, tolerance),
                    variant=variant,
                    kind=kind,
                    **(facts if kind == "same device" else {}),
                )
            )
