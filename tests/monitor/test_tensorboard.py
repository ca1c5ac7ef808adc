"""What a run shows in TensorBoard, for every residual design: every scalar of the tag table
(docs/monitoring.md) and every diagnostic picture or histogram, read back with TensorBoard's own
reader, and the training loss served over HTTP by a real ``tensorboard`` process.

Each design trains 20 steps of a tiny model on the Shakespeare fixture, logging every 5
steps and recording diagnostics every 10.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch

from t2train.config.loader import load_config
from t2train.ports import free_port

from suite_budget import patient

pytestmark = pytest.mark.slow

TINY = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.eval_batches=1",
    "checkpoint.resume=none",
]
RUN = TINY + [
    "train.steps=20",
    "train.warmup_steps=2",
    "train.log_interval=5",
    "train.eval_interval=10",
    "log.diagnostics_interval=10",
]

SUBLAYERS = ["layer_01.attn", "layer_01.mlp", "layer_02.attn", "layer_02.mlp"]
DDL_HISTOGRAMS = {
    f"diagnostics/ddl_{name}/{sublayer}" for name in ("beta", "kx") for sublayer in SUBLAYERS
}
DEPTH_IMAGE = {"diagnostics/depth_attention"}

# variant -> (overrides, extra diagnostic scalars, images, histograms)
VARIANTS = {
    "standard": ([], set(), set(), set()),
    "ddl": (["model.residual=ddl"], set(), set(), DDL_HISTOGRAMS),
    "ddl+shortswa": (
        ["model.residual=ddl", "model.shortswa.window=16"],
        {"diagnostics/shortswa_entropy/layer_01", "diagnostics/shortswa_entropy/layer_02"},
        set(),
        {
            f"diagnostics/ddl_{name}/{sublayer}"
            for name in ("beta", "kx")
            for sublayer in SUBLAYERS + ["layer_01.shortswa", "layer_02.shortswa"]
        },
    ),
    "depth_attn": (
        ["model.residual=depth_attn", "model.depth_attn.window=3"],
        set(),
        DEPTH_IMAGE,
        set(),
    ),
    "attnres": (["model.residual=attnres"], set(), DEPTH_IMAGE, set()),
    "block_attnres": (
        ["model.residual=block_attnres", "model.attnres.block_size=2"],
        set(),
        DEPTH_IMAGE,
        set(),
    ),
    "mhc": (
        ["model.residual=mhc"],
        {f"diagnostics/mhc_gain/{sublayer}" for sublayer in SUBLAYERS},
        set(),
        {
            f"diagnostics/mhc_{kind}/{sublayer}"
            for kind in ("read", "write")
            for sublayer in SUBLAYERS
        },
    ),
}

SCALARS = {
    "train/loss",
    "train/perplexity",
    "train/lr",
    "train/grad_norm",
    "train/param_norm",
    "train/skipped_steps",
    "train/tokens",
    "val/loss",
    "val/perplexity",
    "throughput/tokens_per_sec",
    "throughput/tokens_per_sec_per_device",
    "throughput/tflops_per_device",
    "time/step_seconds",
    "time/data_wait_seconds",
    "memory/rss_gib",
    "pipeline/forward_data_bytes",
    "pipeline/forward_wire_bytes",
    "pipeline/backward_data_bytes",
    "pipeline/backward_wire_bytes",
    "pipeline/forward_hops",
    "checkpoint/save_seconds",
    "diagnostics/residual_rms/layer_01",
    "diagnostics/residual_rms/layer_02",
    "diagnostics/residual_rms/final",
}
if torch.cuda.is_available():
    SCALARS |= {"memory/allocated_gib", "memory/reserved_gib", "memory/peak_allocated_gib"}
IMAGES = {"diagnostics/residual_rms"}


@pytest.fixture(scope="module")
def runs(megatron_world, shakespeare, tmp_path_factory) -> dict:
    """variant -> (run directory, RunSummary, console output)."""
    from t2train.train.loop import train

    root = tmp_path_factory.mktemp("runs")
    done = {}
    for variant, (overrides, *_) in VARIANTS.items():
        config = load_config(
            overrides=[
                f"data.path={shakespeare}",
                f"log.run_dir={root / variant}",
                *RUN,
                *overrides,
            ]
        )
        console = io.StringIO()
        with contextlib.redirect_stdout(console):
            summary = train(config)
        done[variant] = (root / variant, summary, console.getvalue())
    return done


def _events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(
        str(run_dir), size_guidance={"scalars": 0, "images": 0, "histograms": 0}
    )
    events.Reload()
    return events


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_tag_is_logged_with_finite_values(runs, variant):
    run_dir, summary, console = runs[variant]
    _, extra_scalars, extra_images, histograms = VARIANTS[variant]
    events = _events(run_dir)
    tags = events.Tags()

    missing = (SCALARS | extra_scalars) - set(tags["scalars"])
    assert not missing, f"scalars not logged: {sorted(missing)}"
    for tag in tags["scalars"]:
        values = [event.value for event in events.Scalars(tag)]
        assert values and all(math.isfinite(v) for v in values), (tag, values)
    assert [e.step for e in events.Scalars("train/loss")] == [5, 10, 15, 20]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(
        [summary.losses[step] for step in (5, 10, 15, 20)]
    )
    assert [e.step for e in events.Scalars("diagnostics/residual_rms/final")] == [10, 20]
    assert events.Scalars("train/perplexity")[-1].value == pytest.approx(
        math.exp(summary.losses[20]), rel=1e-5
    )

    assert set(tags["images"]) == IMAGES | extra_images
    for tag in tags["images"]:
        pictures = events.Images(tag)
        assert [p.step for p in pictures] == [10, 20]
        assert all(p.width > 100 and p.height > 100 for p in pictures)

    assert set(tags["histograms"]) == histograms
    for tag in histograms:
        for event in events.Histograms(tag):
            histogram = event.histogram_value
            assert (
                histogram.num > 0 and math.isfinite(histogram.min) and math.isfinite(histogram.max)
            ), tag
            if "ddl_beta" in tag:
                assert 0 < histogram.min <= histogram.max < 2, tag

    if not torch.cuda.is_available():
        assert "throughput/mfu" not in tags["scalars"]
        assert console.count("MFU: not applicable on CPU") == 1


def test_metrics_jsonl_holds_the_same_scalars(runs):
    run_dir, summary, _ = runs["standard"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = {tag for record in records for tag in record} - {"step", "time"}
    assert SCALARS <= logged
    losses = {r["step"]: r["train/loss"] for r in records if "train/loss" in r}
    assert losses == pytest.approx({step: summary.losses[step] for step in (5, 10, 15, 20)})


def test_console_is_a_progress_line_per_interval(runs):
    run_dir, _, console = runs["standard"]
    progress = [line for line in console.splitlines() if "tok/s" in line]
    assert len(progress) == 4
    assert (
        f"TensorBoard: tensorboard --logdir {run_dir.parent} (this run is 'standard'; its "
        f"event files are in {run_dir})"
    ) in console
    assert all(" | loss " in line and " | eta " in line for line in progress)
    assert "warning" not in console


def test_pipeline_stages_send_their_diagnostics_and_other_ranks_stay_quiet(shakespeare, tmp_path):
    """TP = 2 x PP = 2 under torchrun: layer 1 lives on the first stage, layer 2 and the
    final norm on the second; every rank runs the diagnostics pass, one per stage sends."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        "--redirects=3",
        f"--log-dir={logs}",
        "-m",
        "t2train.cli",
        "train",
        f"data.path={shakespeare}",
        f"log.run_dir={run_dir}",
        *TINY,
        "train.steps=5",
        "train.warmup_steps=1",
        "train.log_interval=5",
        "train.eval_interval=5",
        "log.diagnostics_interval=5",
        "model.residual=ddl",
        "parallel.tensor=2",
        "parallel.pipeline=2",
    ]
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    events = _events(run_dir)
    tags = events.Tags()
    assert set(tags["histograms"]) == DDL_HISTOGRAMS
    assert {
        "diagnostics/residual_rms/layer_01",
        "diagnostics/residual_rms/layer_02",
        "diagnostics/residual_rms/final",
    } <= set(tags["scalars"])
    forward = events.Scalars("pipeline/forward_data_bytes")[-1].value
    assert forward > 0 and events.Scalars("pipeline/forward_wire_bytes")[-1].value == forward
    [rank0] = logs.glob("*/attempt_0/0")
    assert "step      5/5 | loss" in (rank0 / "stdout.log").read_text()
    for rank in (1, 2, 3):
        [quiet] = logs.glob(f"*/attempt_0/{rank}")
        assert (quiet / "stdout.log").read_text() == "" == (quiet / "stderr.log").read_text()


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def test_a_tensorboard_server_serves_the_training_loss(runs):
    run_dir, summary, _ = runs["standard"]
    port = free_port("127.0.0.1")
    server = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "tensorboard"),
            "--logdir",
            str(run_dir.parent),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load_fast=false",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    run = "standard"  # the run directory's name labels it
    try:
        deadline = time.monotonic() + patient(90)
        while True:
            assert server.poll() is None, f"tensorboard exited: {server.stderr.read()}"
            try:
                if run in _get_json(f"{base}/data/runs"):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "tensorboard did not list the run in 90 s"
            time.sleep(0.5)
        query = urllib.parse.urlencode({"run": run, "tag": "train/loss"})
        points = _get_json(f"{base}/data/plugin/scalars/scalars?{query}")
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert [step for _, step, _ in points] == [5, 10, 15, 20]
    assert [value for _, _, value in points] == pytest.approx(
        [summary.losses[step] for step in (5, 10, 15, 20)]
    )
