"""GPU check, correctness: the GPU-marked tests, and bf16 training against an fp32 CPU reference.

Every registered design, and the baseline with the ShortSWA mixer, trains ``plan.train_steps``
steps twice from the same initial weights on the same batches: once in fp32 on the CPU (a
child process that sees no GPU, started first so it runs while the tests do), once in bf16 on
the GPU (the CPU in the dry run). The losses
must agree within ``plan.loss_rtol`` (relative) at every step: what is left when only the
precision, the device and the kernels (Triton, SDPA/flash) differ.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

from tools.gpu_check.plan import Plan, correctness_variants, make_plan

REPO = Path(__file__).resolve().parents[2]
# torch.distributed variables of the parent's world of one: a child must make its own.
WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Of the section's time, at most, for the GPU-marked tests: 59 s of pytest on an H100, which
# 0.5 of 130 s once fitted and once stopped (the CPU reference trains meanwhile).
PYTEST_SHARE = 0.6
MESSAGE_LINES, MESSAGE_CHARS = 6, 600  # of a test's failure message, kept in the report


def child_env(**extra: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in WORLD_VARIABLES}
    env.update(extra)
    return env


def train_config(plan: Plan, variant: str, precision: str):
    from t2train.bench.variants import variant_config

    return variant_config(
        plan.train_preset,
        None,
        [
            f"data.path={plan.data}",
            *plan.train_overrides,
            f"train.precision={precision}",
            f"train.steps={plan.train_steps}",
        ],
        variant,
    )


def _train(objs, batches) -> list[float]:
    from t2train.engine.megatron.step import train_step

    return [train_step(objs, micro_batches).loss for micro_batches in batches]


def reference_run(plan: Plan, out: Path) -> None:
    """fp32 on the CPU: the batches, then per variant its initial weights and its losses."""
    import torch

    from t2train.bench.step import build_objects, model_vocab_size, real_batches
    from t2train.residual import registered

    variants = plan.items(correctness_variants(registered()))
    first = train_config(plan, variants[0], "fp32")
    batches = real_batches(first, plan.train_steps)
    vocab = model_vocab_size(first)
    torch.save(batches, out / "batches.pt")
    for variant in variants:
        objs = build_objects(train_config(plan, variant, "fp32"), vocab)
        torch.save([chunk.module.state_dict() for chunk in objs.model], out / f"{variant}.pt")
        losses = _train(objs, batches)
        partial = out / f"{variant}.json.tmp"  # renamed when complete: the reader polls for it
        partial.write_text(json.dumps(losses))
        partial.replace(out / f"{variant}.json")


def device_run(plan: Plan, variant: str, reference: Path) -> list[float]:
    """bf16 from the reference's initial weights on the reference's batches."""
    import torch

    from t2train.bench.step import build_objects, model_vocab_size

    config = train_config(plan, variant, "bf16")
    objs = build_objects(config, model_vocab_size(config))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for chunk, state in zip(objs.model, torch.load(reference / f"{variant}.pt")):
        chunk.module.load_state_dict(state)
    objs.optimizer.reload_model_params()  # the fp32 main copies follow the loaded weights
    batches = [
        [{key: t.to(device) for key, t in mb.items()} for mb in step]
        for step in torch.load(reference / "batches.pt")
    ]
    return _train(objs, batches)


def compare(reference: list[float], losses: list[float], rtol: float) -> dict:
    worst = max(abs(a - b) / abs(a) for a, b in zip(reference, losses))
    ok = len(losses) == len(reference) and worst <= rtol
    return {
        "reference": reference,
        "losses": losses,
        "max_rel_diff": worst,
        "rtol": rtol,
        "status": "pass" if ok else "fail",
    }


def _start_reference(plan: Plan, out: Path) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "tools.gpu_check.correctness",
        "--reference",
        str(out),
        "--data",
        plan.data,
    ] + (["--dry-run"] if plan.dry_run else [])
    log = open(out / "reference.log", "w")
    return subprocess.Popen(
        args, env=child_env(CUDA_VISIBLE_DEVICES=""), stdout=log, stderr=subprocess.STDOUT, cwd=REPO
    )


def _junit_items(path: Path) -> list[dict]:
    items = []
    for case in ET.parse(path).iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                # assert_close's message: what, how many elements, the largest differences
                lines = [line for line in (child.get("message") or "").splitlines() if line]
                message = " | ".join(lines[:MESSAGE_LINES])[:MESSAGE_CHARS]
        items.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "message": message,
            }
        )
    return items


def _verbose_items(output) -> list[dict]:
    """The results ``pytest -v`` printed before it was stopped (no failure messages)."""
    text = output.decode(errors="replace") if isinstance(output, bytes) else output
    outcomes = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped"}
    found = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)\b", text, re.MULTILINE)
    return [
        {
            "test": test.replace("/", ".").replace(".py::", "::"),
            "outcome": outcomes[word],
            "message": "",
        }
        for test, word in found
    ]


# One GPU: every test that needs CUDA but not several devices; several: tests/test_multi_gpu.py.
ONE_GPU, MULTI_GPU = "gpu and not multi_gpu", "multi_gpu"
SELECTED = re.compile(r"collected (\d+) items?(?: / (\d+) deselected)?(?: / (\d+) selected)?")


def selected_count(output: str) -> Optional[int]:
    """How many tests pytest was going to run, from its 'collected ...' line."""
    found = SELECTED.search(output or "")
    if not found:
        return None
    collected, deselected, selected = (int(n) if n else None for n in found.groups())
    return selected if selected is not None else (collected or 0) - (deselected or 0)


def gpu_tests(
    section,
    plan: Plan,
    scratch: Path,
    share: float = PYTEST_SHARE,
    marker: str = ONE_GPU,
    key: str = "gpu_tests",
) -> None:
    """``pytest -m MARKER`` over the suite (the dry run: the kernel tests); on CPU they skip.
    Within ``share`` of the section's time left; the report counts what ran, what skipped and
    what was not reached."""
    junit = scratch / f"{key}.xml"
    timeout = max(section.left() * share, 1.0)
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-v",
                "-m",
                marker,
                *plan.gpu_tests,
                "-p",
                "no:cacheprovider",
                "--continue-on-collection-errors",
                f"--junitxml={junit}",
            ],
            env=child_env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        summary = (proc.stdout.strip().splitlines() or [""])[-1]
        output = proc.stdout
        tests = _junit_items(junit) if junit.exists() else []
    except subprocess.TimeoutExpired as stopped:  # no junit file: read the verbose lines
        output = (
            stopped.stdout.decode(errors="replace")
            if isinstance(stopped.stdout, bytes)
            else (stopped.stdout or "")
        )
        tests = _verbose_items(output)
        summary = (
            f"stopped after {timeout:.0f}s (its share of the section's budget); "
            f"{len(tests)} results read from its output"
        )
    counts = {
        outcome: sum(t["outcome"] == outcome for t in tests)
        for outcome in ("passed", "failed", "error", "skipped")
    }
    selected = selected_count(output)
    counts["not reached"] = max(selected - len(tests), 0) if selected is not None else None
    section.data[key] = {
        "paths": plan.gpu_tests,
        "marker": marker,
        "summary": summary,
        "counts": counts,
        "selected": selected,
        "seconds": time.monotonic() - started,
        "not_passed": [t for t in tests if t["outcome"] != "passed"],
    }
    section.save()


def all_gpu_tests(section, plan: Plan) -> None:
    """The --stack section: every one-GPU test, with all of the section's time."""
    gpu_tests(section, plan, section.scratch, share=1.0)


def multi_gpu_tests(section, plan: Plan) -> Optional[str]:
    """The --stack section that runs tests/test_multi_gpu.py where there are 2 or more GPUs
    (``make gpu-check-multi`` runs the same tests); elsewhere the reason it did not run."""
    import torch

    count = torch.cuda.device_count()
    if count < 2:
        return (
            f"{count} CUDA device(s) here: the multi-GPU tests (TP, PP, DP and ZeRO across "
            "2 GPUs, `make gpu-check-multi`) need 2 or more"
        )
    gpu_tests(section, plan, section.scratch, share=1.0, marker=MULTI_GPU, key="gpu_tests")
    return None


def _reference_ready(path: Path, reference: subprocess.Popen, section, reserve: float) -> bool:
    """Wait for one variant's reference while it can still be compared in time."""
    while not path.exists() and reference.poll() is None and section.left() > reserve:
        time.sleep(0.5)
    return path.exists()


def run(section, plan: Plan) -> None:
    """The tests and the reference run side by side; each variant is then compared as soon as
    its reference is written."""
    from t2train.residual import registered

    scratch = section.scratch
    reference = _start_reference(plan, scratch)
    try:
        gpu_tests(section, plan, scratch)
        section.data["training"] = {
            "preset": plan.train_preset,
            "steps": plan.train_steps,
            "overrides": plan.train_overrides,
            "rtol": plan.loss_rtol,
        }
        for variant in plan.items(correctness_variants(registered())):
            _compare_variant(section, plan, variant, reference)
    finally:
        reference.kill()
        reference.wait()


def _compare_variant(section, plan: Plan, variant: str, reference: subprocess.Popen) -> None:
    expected = section.scratch / f"{variant}.json"
    estimate = section.next_item_seconds(default=10.0)
    if not _reference_ready(expected, reference, section, estimate):
        log = (section.scratch / "reference.log").read_text().strip().splitlines() or [""]
        why = (
            section.no_time(estimate) + " (the fp32 reference was not ready)"
            if reference.poll() is None
            else f"no fp32 reference (exit {reference.poll()}): {log[-1]}"
        )
        section.add({"variant": variant, "status": "skipped", "reason": why})
        return
    started = time.monotonic()
    try:
        result = compare(
            json.loads(expected.read_text()),
            device_run(plan, variant, section.scratch),
            plan.loss_rtol,
        )
    except Exception as err:  # reported; the other designs still run
        result = section.error(err)
    section.add(dict(result, variant=variant, seconds=time.monotonic() - started))


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="the fp32 CPU reference of the GPU check")
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    reference_run(make_plan(args.dry_run, args.data), args.reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
