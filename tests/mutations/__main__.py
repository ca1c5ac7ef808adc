"""Run the fast residual and kernel tests once per named mutation; report caught/survived.

    python -m tests.mutations                 # every mutation (about 10 minutes on 2 cores)
    python -m tests.mutations --only ddl-delta-sign window-plus-one
    python -m tests.mutations --list

Each mutation runs in its own pytest process (``-x``: it stops at the first failing test)
with ``tests.mutations.plugin``, which applies the edit in memory. An unmutated baseline run
comes first and must pass. Exit status 0 only if every mutation was caught.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from tests.mutations.catalog import MUTATIONS, ROOT, by_name

TESTS = ["tests/residual", "tests/kernels"]  # the math tests first: most mutations stop there


def run_pytest(name: str | None, tests: list[str]) -> dict:
    """One pytest session with mutation ``name`` (None: unmutated); the plugin's report."""
    with tempfile.TemporaryDirectory() as scratch:
        report = os.path.join(scratch, "report.json")
        env = dict(os.environ, T2_MUTATION=name or "", T2_MUTATION_REPORT=report)
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.mutations.plugin",
            "-m",
            "not slow",
            *tests,
        ]
        started = time.monotonic()
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.monotonic() - started
        if not os.path.exists(report):
            return {
                "verdict": "ERROR",
                "detail": proc.stdout[-2000:] + proc.stderr[-2000:],
                "seconds": seconds,
            }
        with open(report) as f:
            result = json.load(f)
    result["seconds"] = seconds
    missing = sorted(set(result["expected"]) - set(result["applied"]))
    if result["expected"] and not result["applied"]:
        result.update(verdict="ERROR", detail=f"never imported: {missing}")
    elif result["failed"] is None and result["exitstatus"] == 0:
        result.update(verdict="SURVIVED", detail=f"never imported: {missing}" if missing else "")
    elif result["failed"] is None or result["failed"].startswith("collection"):
        result.update(
            verdict="ERROR",
            detail=f"pytest exit {result['exitstatus']}, {result['failed'] or 'no test failed'}",
        )
    else:
        result.update(verdict="caught", detail=result["failed"])
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.mutations",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--jobs", type=int, default=1, help="mutations run in parallel")
    parser.add_argument("--tests", nargs="+", default=TESTS, help="test paths to run")
    args = parser.parse_args(argv)
    mutations = [by_name(n) for n in args.only] if args.only else MUTATIONS
    if args.list:
        for mutation in mutations:
            print(f"{mutation.name:40s} {mutation.design:14s} {mutation.mistake}")
        return 0
    for mutation in mutations:  # a stale mutation fails here, before anything runs
        mutation.mutated_sources()

    started = time.monotonic()
    baseline = run_pytest(None, args.tests)
    print(
        f"baseline (no mutation): {baseline['verdict']} in {baseline['seconds']:.0f} s", flush=True
    )
    if baseline["verdict"] != "SURVIVED":  # the unmutated tests must pass
        print(baseline.get("detail", ""))
        return 2
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [(m, pool.submit(run_pytest, m.name, args.tests)) for m in mutations]
        results = []
        for mutation, future in futures:
            result = future.result()
            results.append(result["verdict"])
            print(
                f"{result['verdict']:8s} {result['seconds']:5.0f} s  {mutation.name:40s} "
                f"{result['detail']}",
                flush=True,
            )
    caught = results.count("caught")
    print(
        f"\n{caught}/{len(results)} mutations caught, "
        f"{results.count('SURVIVED')} survived, {results.count('ERROR')} errors, "
        f"{time.monotonic() - started:.0f} s"
    )
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
