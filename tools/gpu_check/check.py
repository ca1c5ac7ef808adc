"""``python -m tools.gpu_check.check --out DIR [--dry-run]``: the one-command GPU check.

Runs the sections of ``plan.SECTIONS`` (environment, correctness, step cost, MFU, kernels,
profile) and writes ``DIR/gpu-report.md``, ``DIR/gpu-report.json`` and ``DIR/gpu-check.log``;
``--quick`` runs ``plan.QUICK_SECTIONS`` on the baseline and the targeted variants only;
``--stack`` runs ``plan.STACK_SECTIONS`` (the GPU-marked tests, resume, DeepSpeed, the
planner's memory, FP8 and recompute, TensorBoard and export, the multi-GPU tests), a command of
its own; ``--speed`` and ``--quality`` are the GPU window's two calls
(``plan.SPEED_SECTIONS``: the headline, every variant's step cost, MFU, profiles;
``plan.QUALITY_SECTIONS``: correctness, every kernel row, the GPU comparison until the time
is up).

Time: section i must end by the sum of the budgets of sections 1..i (so time one section
leaves unspent goes to the next). A section skips what would not fit, with the reason, and
is stopped if it overruns its end by ``GRACE`` seconds. Isolation: the sections run in a
worker process; if it dies (a CUDA fault poisons the process) or is stopped, the section it
was in is recorded as such and a fresh worker runs the remaining ones, so a partial run
still reports. ``--dry-run`` runs the same plan on the CPU at tiny shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from t2train.nn.compiling import BACKEND_VARIABLE
from tools.gpu_check.plan import (
    ALL_SECTIONS,
    MODES,
    QUALITY_SECTIONS,
    QUICK_SECTIONS,
    SECTIONS,
    SPEED_SECTIONS,
    STACK_SECTIONS,
    Plan,
    make_plan,
)

GRACE = 20.0  # seconds past its end before a section's worker is stopped
MIN_SECTION = 5.0  # a section with less time than this left is skipped
DEFAULT_DATA = ".gpu-bundle/data/shakespeare-bpe4k-s4096"


class Section:
    """One section's results, saved to its JSON file after every change."""

    def __init__(self, name: str, path: Path, end: float, scratch: Path):
        self.path, self.end, self.scratch = path, end, scratch
        self.result: dict[str, Any] = {
            "name": name,
            "status": "running",
            "reason": "",
            "seconds": 0.0,
            "started": time.time(),
            "items": [],
            "data": {},
        }
        self.runs: list[tuple[float, float]] = []  # (seconds, warm-up) of each item's run

    @property
    def data(self) -> dict:
        return self.result["data"]

    def left(self) -> float:
        return self.end - time.time()

    def fits(self, estimate: float) -> bool:
        return estimate <= self.left()

    def next_item_seconds(self, default: float) -> float:
        """The cost estimate of the next item: the previous one's time less its warm-up (the
        steady state), plus the median warm-up so far (neither a first, cold compile nor an
        eager item's warm-up is the next item's compile)."""
        if not self.runs:
            return default
        warmups = [warmup for _, warmup in self.runs]
        return self.runs[-1][0] - warmups[-1] + statistics.median(warmups)

    def note_run(self, seconds: float, warmup: Optional[float]) -> None:
        """A run that was not added as an item of its own (a later repeat of a row)."""
        self.runs.append((seconds, warmup or 0.0))

    def no_time(self, estimate: float) -> str:
        return (
            f"would overrun the section's time: needs about {estimate:.0f}s (the previous "
            f"item's time less its warm-up plus the median warm-up, or a prior), "
            f"{max(self.left(), 0):.0f}s left"
        )

    @staticmethod
    def error(err: Exception) -> dict:
        """An item's fields for an exception being handled: the message and where it came
        from (a kernel's launch error names no kernel without its traceback)."""
        return {
            "status": "error",
            "reason": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc()[-2000:],
        }

    def add(self, item: dict) -> None:
        self.result["items"].append(item)
        if "seconds" in item:
            self.note_run(item["seconds"], item.get("warmup_s"))
        self.save()

    def save(self) -> None:
        self.result["seconds"] = time.time() - self.result["started"]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.path)


def _section_runner(name: str):
    """The function that runs section ``name``: it fills the section in, and returns None or
    the reason the section does not apply here (then recorded as skipped)."""
    from tools.gpu_check import (
        compare,
        correctness,
        engines,
        env,
        kernels,
        memory,
        options,
        outputs,
        perf,
        profile,
        resume,
    )

    return {
        "env": env.run,
        "correctness": correctness.run,
        "step_cost": perf.step_cost,
        "mfu": perf.mfu,
        "kernels": kernels.run,
        "profile": profile.run,
        "gpu_tests": correctness.all_gpu_tests,
        "resume": resume.run,
        "deepspeed": engines.run,
        "memory": memory.run,
        "options": options.run,
        "outputs": outputs.run,
        "multi_gpu": correctness.multi_gpu_tests,
        "comparison": compare.section,
    }[name]


def work(plan: Plan, names: list[str], ends: dict, results: Path) -> int:
    """The worker: run sections in order, each until its end time."""
    for name in names:
        section = Section(name, results / f"{name}.json", ends[name], results / name)
        section.scratch.mkdir(exist_ok=True)
        if section.left() < MIN_SECTION:
            section.result.update(
                status="skipped",
                reason=("no time left: the sections before it used the plan's budget up to here"),
            )
            section.save()
            continue
        section.save()
        print(f"gpu_check: section {name} ({section.left():.0f}s)", flush=True)
        try:
            not_here = _section_runner(name)(section, plan)
            section.result.update(status="skipped" if not_here else "ok", reason=not_here or "")
            for status in ("error", "skipped"):
                items = [item for item in section.result["items"] if item.get("status") == status]
                if items:
                    section.result.update(
                        status="partial",
                        reason=(f"{len(items)} item(s) {status}, the first: {items[0]['reason']}"),
                    )
        except Exception as err:  # reported, and the next section runs
            section.result.update(
                status="failed",
                reason=f"{type(err).__name__}: {err}",
                traceback=traceback.format_exc()[-3000:],
            )
        section.save()
    return 0


def _load(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _finish_interrupted(results: Path, name: str, status: str, reason: str) -> None:
    result = _load(results / f"{name}.json") or {
        "name": name,
        "items": [],
        "data": {},
        "seconds": 0.0,
    }
    result.update(
        status=status, reason=reason, seconds=time.time() - result.get("started", time.time())
    )
    (results / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))


def orchestrate(
    plan: Plan, names: list[str], results: Path, log, started: float, on_progress
) -> None:
    """Run the sections in workers, restarting past a section whose worker died or overran;
    ``on_progress()`` after each section ends, so a run stopped from outside still reports."""
    ends, total = {}, started
    for name in names:
        total += plan.budgets[name]
        ends[name] = total
    pending, reported = list(names), 0
    while pending:
        args = [
            sys.executable,
            "-m",
            "tools.gpu_check.check",
            "--worker",
            str(results),
            "--data",
            plan.data,
            "--sections",
            ",".join(pending),
            "--ends",
            json.dumps({name: ends[name] for name in pending}),
        ]
        # Its own process group, so that stopping it also stops its children (the CPU
        # reference, pytest, compile workers).
        flags = ["--dry-run"] * plan.dry_run + [f"--{plan.mode}"] * (plan.mode != "full")
        flags += ["--rehearse"] * plan.rehearsal + ["--out", plan.out] * bool(plan.out)
        worker = subprocess.Popen(
            args + flags, stdout=log, stderr=subprocess.STDOUT, preexec_fn=os.setpgrp
        )
        while worker.poll() is None:
            statuses = [(_load(results / f"{n}.json") or {}).get("status") for n in pending]
            if (
                "running" in statuses
                and time.time() > ends[pending[statuses.index("running")]] + GRACE
            ):
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
                break
            finished = sum(status not in (None, "running") for status in statuses)
            if finished > reported:
                reported = finished
                on_progress()
            time.sleep(0.5)
        done = [
            n
            for n in pending
            if (_load(results / f"{n}.json") or {}).get("status") not in (None, "running")
        ]
        stuck = [n for n in pending if n not in done]
        if not stuck:
            return
        name = stuck[0]
        if worker.returncode not in (0, None) and time.time() <= ends[name] + GRACE:
            _finish_interrupted(
                results,
                name,
                "failed",
                f"the worker process died (exit {worker.returncode}); see gpu-check.log",
            )
        else:
            _finish_interrupted(
                results,
                name,
                "timeout",
                f"stopped {GRACE:.0f}s after the end of its time ({plan.budgets[name]}s budget)",
            )
        pending, reported = pending[pending.index(name) + 1 :], 0
        on_progress()


def check(plan: Plan, out: Path, names: list[str]) -> dict:
    from tools.gpu_check.report import NOT_ASKED, write_report

    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with (
        tempfile.TemporaryDirectory(prefix="t2train-gpu-check-") as tmp,
        open(out / "gpu-check.log", "a") as log,
    ):
        results = Path(tmp)
        # Reading decompresses shards beside them: a copy keeps the bundle as it was built.
        plan = dataclasses.replace(plan, data=str(shutil.copytree(plan.data, results / "data")))

        def report() -> dict:
            sections = {name: _load(results / f"{name}.json") for name in plan.report_sections}
            not_asked = {"status": "skipped", "reason": NOT_ASKED}
            return write_report(
                plan,
                {
                    name: sections[name] or (None if name in names else not_asked)
                    for name in plan.report_sections
                },
                out,
                time.time() - started,
            )

        orchestrate(plan, names, results, log, started, report)
        return report()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for gpu-report.md/.json and the log")
    parser.add_argument(
        "--data",
        default=DEFAULT_DATA,
        help=f"prepared dataset (default: the bundle's, {DEFAULT_DATA})",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the whole plan on the CPU at tiny shapes (kernels interpreted)",
    )
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="the dry run with one item per section: every section's code once (minutes)",
    )
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument(
        "--quick",
        action="store_true",
        help="the baseline and the targeted variants only, sections "
        f"{', '.join(QUICK_SECTIONS)} (about 4 minutes on a GPU)",
    )
    modes.add_argument(
        "--stack",
        action="store_true",
        help="the rest of the stack instead, sections "
        f"{', '.join(STACK_SECTIONS)} (its own 10-minute command)",
    )
    modes.add_argument(
        "--speed",
        action="store_true",
        help="the GPU window's first call: the headline at both presets (repeated in turns), "
        f"every variant's step cost, MFU, every design's profile; sections "
        f"{', '.join(SPEED_SECTIONS)} (a 10-minute command)",
    )
    modes.add_argument(
        "--quality",
        action="store_true",
        help="the GPU window's second call: bf16 correctness of every design, every kernel "
        "row, then the GPU comparison until the command's time is up (its records in "
        f"OUT/records); sections {', '.join(QUALITY_SECTIONS)} (a 10-minute command)",
    )
    parser.add_argument(
        "--only",
        choices=ALL_SECTIONS,
        action="append",
        help="run only these sections (repeatable; default all, in the order "
        f"{', '.join(SECTIONS)}, or with --stack {', '.join(STACK_SECTIONS)})",
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--sections", help=argparse.SUPPRESS)
    parser.add_argument("--ends", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.dry_run = args.dry_run or args.rehearse
    if args.dry_run:
        # One intra-op thread in every process of the dry run (the worker, the reference's
        # process, pytest, the CPU reference): its tensors are tiny, and its processes share
        # a small CPU with each other and with whatever else runs there, where spinning
        # OpenMP threads made a tiny step take a second (the timings mean nothing here).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined
        # The fused path's graphs without Inductor's code generation (minutes on a CPU); in
        # the quick dry run with the kernels as the GPU runs them (custom operators, under
        # the interpreter: plan.py says what it compiles).
        os.environ.setdefault(BACKEND_VARIABLE, "aot_eager")
        if args.quick:
            os.environ.setdefault("T2_KERNELS", "triton")
    mode = next((name for name in MODES if getattr(args, name, False)), "full")
    plan = make_plan(
        args.dry_run,
        args.data,
        rehearsal=args.rehearse,
        mode=mode,
        out=str(args.out) if args.out else "",
    )
    if args.worker:
        return work(plan, args.sections.split(","), json.loads(args.ends), args.worker)
    if args.out is None:
        parser.error("--out is required")
    if not Path(plan.data, "index.json").exists():
        print(
            f"error: --data {plan.data}: no prepared dataset there (make gpu-bundle builds "
            "one into .gpu-bundle/)",
            file=sys.stderr,
        )
        return 2
    report = check(
        plan,
        args.out,
        [name for name in plan.report_sections if name in (args.only or plan.sections)],
    )
    print(f"gpu_check: wrote {args.out}/gpu-report.md ({report['verdict']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
