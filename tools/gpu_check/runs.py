"""Training runs of the --stack sections: ``train()`` on a variant, here or in a fresh process,
and what its run directory holds afterwards (per-step scalars, checkpoint size).

``python -m tools.gpu_check.runs RUNS.json OUT.json`` trains, in order and in one process,
the runs listed in ``RUNS.json`` (``[{"name", "preset", "variant", "overrides"}]``) and writes
``{name: {"losses", "load_seconds", "seconds", "run_dir", "device"}}``: what a section needs
from a process of its own (the resume section starts a fresh one to resume in).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from t2train.bench.run_records import METRICS_FILE
from tools.gpu_check.correctness import REPO, child_env

LOADED = re.compile(r"loaded in ([0-9.]+)s")  # the trainer's console line after a resume


def run_spec(name: str, preset: str, variant: str, overrides, **extra) -> dict:
    return {
        "name": name,
        "preset": preset,
        "variant": variant,
        "overrides": list(overrides),
        **extra,
    }


def train_run(spec: dict) -> dict:
    """Train one run here; its losses, time, load time (a resume) and device."""
    import torch

    from t2train.bench.variants import variant_config
    from t2train.train.loop import train

    torch._dynamo.reset()  # each run's fused path compiles afresh (dynamo's recompile limit)
    config = variant_config(spec["preset"], None, spec["overrides"], spec["variant"])
    console = io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(console):
        summary = train(config)
    loaded = LOADED.search(console.getvalue())
    return {
        "losses": {str(step): loss for step, loss in summary.losses.items()},
        "seconds": time.monotonic() - started,
        "load_seconds": float(loaded.group(1)) if loaded else None,
        "run_dir": str(summary.run_dir),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }


def train_in_process(
    specs: list[dict], scratch: Path, label: str, timeout: float, cpu: bool = False
) -> dict:
    """Train ``specs`` in a fresh process (on the CPU only with ``cpu``); its results by name.
    Raises with the log's tail if it fails or overruns ``timeout``."""
    runs, out, log = (scratch / f"{label}.{kind}" for kind in ("runs.json", "json", "log"))
    runs.write_text(json.dumps(specs))
    env = child_env(**({"CUDA_VISIBLE_DEVICES": ""} if cpu else {}))
    with log.open("w") as stream:
        proc = subprocess.run(
            [sys.executable, "-m", "tools.gpu_check.runs", str(runs), str(out)],
            env=env,
            cwd=REPO,
            stdout=stream,
            stderr=subprocess.STDOUT,
            timeout=max(timeout, 1.0),
        )
    if proc.returncode != 0:
        tail = " | ".join(log.read_text().strip().splitlines()[-6:])
        raise RuntimeError(f"{label}: the process failed (exit {proc.returncode}): {tail[-1500:]}")
    return json.loads(out.read_text())


def scalars(run_dir: Path) -> dict[int, dict]:
    """step -> every scalar the run logged at that step (``metrics.jsonl``)."""
    steps: dict[int, dict] = {}
    for line in (Path(run_dir) / METRICS_FILE).read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(int(record["step"]), {}).update(record)
    return steps


def size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 2**20


def main(argv=None) -> int:
    runs, out = (Path(arg) for arg in (argv or sys.argv[1:]))
    results = {spec["name"]: train_run(spec) for spec in json.loads(runs.read_text())}
    out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
