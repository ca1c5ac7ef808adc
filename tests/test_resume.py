"""Resuming continues a run as if it had never stopped (fp32, CPU, gloo, real processes).

* every residual design (the mixer on one of each kind of stream state, ``tests/variants.py``,
  DDL's d_v columns, Full AttnRes under selective recompute), with dropout: 2N steps
  straight vs N, save, a fresh process resumes, N more: the per-step losses are bitwise
  identical, and so are the RNG streams saved at step 2N (nothing draws from them between
  the restore and the next step);
* layout changes through the fully reshardable checkpoint: (TP, PP) = (1, 1) -> (2, 2) and
  (2, 2) -> (1, 1): after loading, the model and optimizer tensors equal the
  saved ones exactly, and the next losses equal the uninterrupted (1, 1) run within 1e-5;
* kill -9 during a save: the half-written checkpoint is ignored, the run resumes from the
  previous one and its losses equal the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from t2train.checkpoint.store import find_latest
from t2train.run_lock import LOCK_FILE

from suite_budget import patient
from torchrun_helper import REPO, child_env, run_torchrun
from variants import every_design

pytestmark = pytest.mark.slow

N = 2  # steps before the checkpoint; runs go to 2N (3N for the kill test)
TINY = [
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.lr=3e-3",
    "train.min_lr=3e-4",
    "train.warmup_steps=1",
    "train.eval_batches=1",
    "train.eval_interval=1000",
    "train.log_interval=1",
    "log.tensorboard=false",
]


# Options that give a 2-layer model something to resume (by variant, else by design): a
# window that slides, blocks that close (a block size divides the sublayers: 4 alone, 6 with
# the mixer); the mixer's window shorter than the sequence.
OPTIONS = {
    "attnres": ["model.recompute=selective"],  # its dropout masks redrawn in the recompute
    "depth_attn": ["model.depth_attn.window=3"],
    "block_attnres": ["model.attnres.block_size=2"],
    "block_attnres+shortswa": ["model.attnres.block_size=3"],
}
MIXER = ["model.shortswa.window=16"]
EXTRAS = {"ddl_dv4": ["model.residual=ddl", "model.ddl.dv=4"]}  # d_v columns: a wider state


def _variants() -> dict[str, list[str]]:
    variants = {}
    for variant in every_design():
        design, plus, _ = variant.partition("+")
        options = OPTIONS.get(variant, OPTIONS.get(design, []))
        variants[variant] = [f"model.residual={design}", *options]
        variants[variant] += MIXER if plus else []
    return {**variants, **EXTRAS}


def test_every_design_resumes_with_bitwise_identical_losses(shakespeare, tmp_path):
    args = ["--data", str(shakespeare), "--root", str(tmp_path), "--steps-before-save", str(N)]
    args += ["--variants", json.dumps(_variants())]
    straight = run_torchrun(
        "resume_designs.py", 1, [*args, "--phase", "straight"], tmp_path / "straight.json"
    )
    resumed = run_torchrun(
        "resume_designs.py", 1, [*args, "--phase", "resume"], tmp_path / "resumed.json"
    )
    for design, run in straight.items():
        tail = {step: loss for step, loss in run["losses"].items() if int(step) > N}
        assert len(tail) == N
        assert resumed[design]["losses"] == tail, design  # exact float equality
        assert resumed[design]["rng"] == run["rng"], design


def _train(
    run_dir: Path, nproc: int, *overrides: str, timeout: int = 600, output: Optional[list] = None
) -> dict[int, float]:
    """``t2train train`` on ``nproc`` torchrun processes; returns its per-step losses (and
    appends its output to ``output``, if given)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "t2train.cli",
        "train",
        *TINY,
        f"log.run_dir={run_dir}",
        *overrides,
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=child_env()
    )
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    if output is not None:
        output.append(proc.stdout + proc.stderr)
    return _losses(run_dir)


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def _consolidated(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of a checkpoint as full (unsharded) tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(out))
    return {
        key: value
        for key, value in torch.load(out, weights_only=False).items()
        if isinstance(value, torch.Tensor)
    }


def _assert_same_tensors(saved: dict, reloaded: dict) -> None:
    assert saved.keys() == reloaded.keys()
    assert any(key.startswith("optimizer.") for key in saved)
    for key, value in saved.items():
        assert torch.equal(reloaded[key], value), key


def _near(resumed: dict, reference: dict, steps) -> None:
    for step in steps:
        assert abs(resumed[step] - reference[step]) < 1e-5, (step, resumed[step], reference[step])


def test_layout_changes_resume_through_resharding(shakespeare, tmp_path):
    """Every run starts from the (1, 1) run's step-N state (weights are initialised per
    layout, so runs from scratch at different layouts differ from step 1). With
    ``checkpoint.save_on_resume`` a run saves step N again in its own layout right after
    loading, which shows the loaded tensors exactly."""
    data = f"data.path={shakespeare}"
    tail = range(N + 1, 2 * N + 1)
    reference = _train(
        tmp_path / "tp1pp1",
        1,
        data,
        f"train.steps={2 * N}",
        f"checkpoint.interval={N}",
        "checkpoint.resume=none",
    )

    def step_n(run: str) -> Path:
        return tmp_path / run / "checkpoints" / f"step_{N:08d}"

    def resume(run: str, nproc: int, source: Path, *layout: str) -> dict[str, torch.Tensor]:
        """Resume ``source`` at a layout: its next losses match, its step-N save is returned."""
        losses = _train(
            tmp_path / run,
            nproc,
            data,
            f"train.steps={2 * N}",
            f"checkpoint.interval={N}",
            f"checkpoint.resume={source}",
            "checkpoint.save_on_resume=true",
            *layout,
        )
        assert sorted(losses) == list(tail)
        _near(losses, reference, tail)
        return _consolidated(step_n(run), tmp_path / f"{run}.pt")

    reference_state = _consolidated(step_n("tp1pp1"), tmp_path / "tp1pp1.pt")
    tp2pp2_state = resume("tp2pp2", 4, step_n("tp1pp1"), "parallel.tensor=2", "parallel.pipeline=2")
    _assert_same_tensors(reference_state, tp2pp2_state)  # (1, 1) -> (2, 2)
    _assert_same_tensors(tp2pp2_state, resume("tp1pp1-from-tp2pp2", 1, step_n("tp2pp2")))


def test_kill_9_during_a_save_resumes_from_the_previous_checkpoint(shakespeare, tmp_path):
    data = f"data.path={shakespeare}"
    steps = [f"train.steps={3 * N}", f"checkpoint.interval={N}"]
    reference = _train(tmp_path / "straight", 1, data, *steps, "checkpoint.resume=none")

    # Killed mid-save: every shard of step 2N is written, it is not published yet.
    run_dir = tmp_path / "killed"
    _kill_before_publishing(run_dir, 2 * N, data, steps)
    checkpoints = run_dir / "checkpoints"
    assert not (checkpoints / f"step_{2 * N:08d}").exists()
    assert (checkpoints / "latest").read_text().strip() == f"step_{N:08d}"

    with pytest.warns(UserWarning, match="incomplete checkpoint"):
        assert find_latest(checkpoints) == checkpoints / f"step_{N:08d}"
    killed = json.loads((run_dir / LOCK_FILE).read_text())["pid"]
    # The next start removes the unfinished save and takes the dead run's lock over, and says
    # both in one line: nothing is left to clean by hand (the staging directory stayed).
    output: list = []
    resumed = _train(run_dir, 1, data, *steps, "checkpoint.resume=auto", output=output)
    (line,) = [line for line in output[0].splitlines() if "ended without cleaning up" in line]
    assert (
        line
        == (
            f"t2train: an earlier run of {run_dir} ended without cleaning up: took over its lock "
            f"{run_dir / LOCK_FILE} (host {socket.gethostname()}, pid {killed}, "
        )
        + line.split(f"pid {killed}, ", 1)[1]
    ), line
    assert line.endswith(
        f"; removed its unfinished save {checkpoints / f'step_{2 * N:08d}.incomplete'}"
    ), line
    assert not list(checkpoints.glob("*.incomplete"))
    assert "ignoring incomplete checkpoint" not in output[0], output[0][-3000:]
    after_restart = {step: loss for step, loss in resumed.items() if step > N and step in reference}
    assert sorted(after_restart) == list(range(N + 1, 3 * N + 1))
    assert all(after_restart[step] == reference[step] for step in after_restart)


def _kill_before_publishing(run_dir: Path, step: int, data: str, steps: list[str]) -> None:
    """Run the trainer until its ``step`` save has written every shard, then SIGKILL it."""
    marker = run_dir.parent / f"{run_dir.name}.hanging"
    cmd = [
        sys.executable,
        str(REPO / "tests" / "workers" / "hang_before_publish.py"),
        str(step),
        str(marker),
        "--",
        *TINY,
        data,
        *steps,
        f"log.run_dir={run_dir}",
        "checkpoint.resume=none",
    ]
    log = run_dir.parent / f"{run_dir.name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=child_env(),
        )
    deadline = time.monotonic() + patient(300)
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and any checkpoint writers
    proc.wait()
    assert marker.exists(), f"no step-{step} save was reached:\n{log.read_text()[-6000:]}"
