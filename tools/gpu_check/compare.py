"""``python3 -m tools.gpu_check.compare OUT``: the next share of the GPU comparison, in one
GPU job.

The comparison at GPU scale (docs/benchmarks.md) trains the batch of ``comparison.yaml`` (ten
variants x three seeds of the ``20m`` preset) on the bundle's held-out split. One H100/H200
needs longer than one 10-minute job for all of it, so it can be completed over several short
jobs, and only the runs' records
travel between them (a few kB each), never checkpoints:

1. install ``.gpu-bundle/`` (as the GPU check does);
2. copy the finished runs' records already committed in ``docs/results/compare-gpu/`` (each run's
   ``metrics.jsonl`` and ``config.yaml``) into a scratch batch directory;
3. ``t2train experiment compare`` the whole batch there with ``--time-budget-min``: it reads
   the finished runs and trains the next ones while the slowest run so far still fits;
4. copy every run finished now (records only) and the batch's ``compare.md`` and figures into
   ``OUT/records``; checkpoints and TensorBoard events stay in the scratch directory.

Back in the checkout: ``python -m tools.gpu_check.compare --merge OUT/records`` adds the
new records to ``docs/results/compare-gpu/`` and writes its ``compare.md`` and figures over every
finished run (``--report-only``: nothing is trained; the report lists the runs still missing).

``--dry-run`` does the same on the CPU at tiny shapes with ``--data`` (the tests' dataset).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import yaml

from t2train.bench.run_records import CONFIG_FILE, METRICS_FILE, finished_curve

BUNDLE = ".gpu-bundle"
DATA = f"{BUNDLE}/data/shakespeare-heldout-bpe4k-s1024"
RECORDS = Path("docs/results/compare-gpu")
BATCH = Path(__file__).with_name("comparison.yaml")  # what the batch trains


def batch_spec(dry_run: bool) -> dict:
    """``comparison.yaml``'s batch: preset, designs, seeds, steps, overrides."""
    spec = yaml.safe_load(BATCH.read_text())
    return {**spec, **spec["dry_run"]} if dry_run else spec


def compare_args(data: str, dry_run: bool) -> list[str]:
    """``t2train experiment compare``'s arguments for the batch, without ``--out``."""
    spec = batch_spec(dry_run)
    return [
        "experiment",
        "compare",
        "--preset",
        spec["preset"],
        f"data.path={data}",
        *spec["overrides"],
        "--designs",
        spec["designs"],
        "--seeds",
        str(spec["seeds"]),
        "--steps",
        str(spec["steps"]),
    ]


def copy_finished(source: Path, dest: Path, steps: int) -> list[str]:
    """Copy the records of every run in ``source`` that evaluated its last step into
    ``dest`` (one folder per run, as the batch names them); the names copied."""
    copied = []
    for run in sorted(path for path in source.iterdir() if path.is_dir()):
        if not finished_curve(run, steps):
            continue
        (dest / run.name).mkdir(parents=True, exist_ok=True)
        for name in (METRICS_FILE, CONFIG_FILE):
            if (run / name).is_file():
                shutil.copyfile(run / name, dest / run.name / name)
        copied.append(run.name)
    return copied


def copy_report(source: Path, dest: Path) -> None:
    for path in [source / "compare.md", *source.glob("*.png")]:
        if path.is_file():
            shutil.copyfile(path, dest / path.name)


def run_compare(args: list[str], log: Optional[Path] = None) -> int:
    """``t2train experiment compare ARGS``; with ``log``, its output there, in an environment
    without the caller's torch.distributed world (the check's worker has one)."""
    if log is None:
        return subprocess.call([sys.executable, "-m", "t2train.cli", *args])
    from tools.gpu_check.correctness import child_env

    with log.open("w") as stream:
        return subprocess.call(
            [sys.executable, "-m", "t2train.cli", *args],
            stdout=stream,
            stderr=subprocess.STDOUT,
            env=child_env(),
        )


def share(
    kept: Path,
    records: Path,
    budget_min: float,
    data: str,
    dry_run: bool,
    log: Optional[Path] = None,
) -> dict:
    """The batch resumed from ``records`` in a scratch directory, trained for ``budget_min``
    minutes; every run finished now (records only) and the report copied to ``kept``. The
    runs finished before, those finished now, and ``experiment compare``'s exit code."""
    steps = batch_spec(dry_run)["steps"]
    kept.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="t2-compare-") as scratch:
        batch = Path(scratch)
        earlier = copy_finished(records, batch, steps) if records.is_dir() else []
        print(f"{len(earlier)} run(s) finished in earlier jobs ({records})", flush=True)
        code = run_compare(
            [
                *compare_args(data, dry_run),
                "--out",
                str(batch),
                "--time-budget-min",
                f"{budget_min:g}",
            ],
            log,
        )
        new = [name for name in copy_finished(batch, kept, steps) if name not in earlier]
        copy_report(batch, kept)
    return {"earlier": earlier, "new": new, "exit": code}


def batch_size(dry_run: bool) -> int:
    """Runs in the whole batch: variants x seeds."""
    spec = batch_spec(dry_run)
    return len(spec["designs"].split(",")) * int(spec["seeds"])


def run_share(out: Path, records: Path, budget_min: float, data: str, dry_run: bool) -> int:
    """One GPU job's share: the batch resumed from ``records``, new records into OUT."""
    if not dry_run:
        subprocess.run(
            [sys.executable, "-m", "tools.gpu_check.install", "--bundle", BUNDLE], check=True
        )
    kept = out / "records"
    result = share(kept, records, budget_min, data, dry_run)
    print(
        f"this job finished {len(result['new'])} run(s): {', '.join(result['new']) or 'none'}; "
        f"their records are in {kept}; in the checkout: python -m tools.gpu_check.compare "
        f"--merge {kept}"
    )
    return result["exit"]


# Of the section's time, kept for writing the batch's report and figures after the last run.
REPORT_RESERVE_S = 20.0


def section(section, plan) -> None:
    """The GPU check's comparison section (``--quality``): the batch resumed from the records
    committed in ``docs/results/compare-gpu/`` (the dry run: none, its own tiny batch on the check's
    dataset), trained until the section's time is up, the runs finished now kept in
    ``OUT/records`` for ``--merge`` in the checkout."""
    out = Path(plan.out) if plan.out else section.scratch
    kept = out / "records"
    records = section.scratch / "no-earlier-records" if plan.dry_run else RECORDS
    data = plan.data if plan.dry_run else DATA
    budget_s = max(section.left() - REPORT_RESERVE_S, 1.0)
    log = section.scratch / "compare.log"
    section.data.update(
        batch=str(BATCH.name),
        runs_in_batch=batch_size(plan.dry_run),
        records_from=str(records),
        records_to=str(kept),
        data=data,
        budget_s=budget_s,
    )
    section.save()
    result = share(kept, records, budget_s / 60, data, plan.dry_run, log)
    tail = log.read_text().strip().splitlines()[-8:] if log.is_file() else []
    section.data.update(result, log_tail=tail)
    for name in result["new"]:
        section.add({"name": name, "status": "ok"})
    if result["exit"] != 0:
        if not result["new"]:
            raise RuntimeError(
                f"t2train experiment compare failed (exit {result['exit']}): {' | '.join(tail)}"
            )
        section.add(
            {
                "name": "t2train experiment compare",
                "status": "error",
                "reason": f"exit {result['exit']}: {' | '.join(tail)[-600:]}",
            }
        )


def merge(new_records: Path, records: Path, data: str, dry_run: bool) -> int:
    """Add a job's records to ``records`` and report over every finished run."""
    steps = batch_spec(dry_run)["steps"]
    records.mkdir(parents=True, exist_ok=True)
    added = copy_finished(new_records, records, steps)
    print(f"merged {len(added)} run(s) into {records}", flush=True)
    return run_compare([*compare_args(data, dry_run), "--out", str(records), "--report-only"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "out", nargs="?", type=Path, help="(on the GPU) where this job's records go (OUT/records)"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        metavar="NEW_RECORDS",
        help="(in the checkout) add a job's records to --records and write the report",
    )
    parser.add_argument(
        "--records",
        type=Path,
        default=RECORDS,
        help=f"the batch's finished runs so far (default {RECORDS})",
    )
    parser.add_argument(
        "--budget-min",
        type=float,
        default=8.5,
        help="start no run that would end later than this (default 8.5, inside a 10-minute job)",
    )
    parser.add_argument("--data", default=DATA, help=f"the held-out dataset (default {DATA})")
    parser.add_argument(
        "--dry-run", action="store_true", help="the same procedure on the CPU at tiny shapes"
    )
    args = parser.parse_args(argv)
    if (args.out is None) == (args.merge is None):
        parser.error("give OUT (a GPU job) or --merge NEW_RECORDS (in the checkout), not both")
    if not Path(args.data, "index.json").is_file():
        parser.error(f"--data {args.data}: no prepared dataset there (make gpu-bundle builds it)")
    if args.merge is not None:
        return merge(args.merge, args.records, args.data, args.dry_run)
    return run_share(args.out, args.records, args.budget_min, args.data, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
