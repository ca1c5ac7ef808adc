"""Several attempts in one run directory keep one run's metrics: an attempt that failed
before its first checkpoint leaves nothing behind for the next, and a resumed attempt drops
what the failed one logged after the checkpoint (in-process, one rank)."""

from __future__ import annotations

import json

import pytest

from t2train.config.loader import load_config
from t2train.engine.megatron import MegatronEngine
from t2train.train.loop import train

pytestmark = pytest.mark.slow

TINY_MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
              "model.seq_length=64", "train.micro_batch_size=4", "train.global_batch_size=8",
              "train.warmup_steps=1", "train.eval_batches=1", "train.log_interval=1"]


def _attempt(run_dir, data, monkeypatch, fail_at_call=None, steps=4):
    """``t2train train`` in this process; its ``fail_at_call``-th training step raises."""
    calls = []
    real_step = MegatronEngine.train_step

    def train_step(engine, micro_batches):
        calls.append(1)
        if len(calls) == fail_at_call:
            raise RuntimeError("injected failure")
        return real_step(engine, micro_batches)

    monkeypatch.setattr(MegatronEngine, "train_step", train_step)
    config = load_config(overrides=[*TINY_MODEL, f"data.path={data}", f"log.run_dir={run_dir}",
                                    f"train.steps={steps}", "checkpoint.interval=2",
                                    "train.eval_interval=100", "log.diagnostics_interval=0"])
    if fail_at_call is None:
        return train(config)
    with pytest.raises(RuntimeError, match="injected failure"):
        train(config)


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _event_files(run_dir) -> list:
    return sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_attempts_in_one_run_directory_never_mix_metrics(megatron_world, shakespeare, tmp_path,
                                                         monkeypatch, capsys):
    run_dir = tmp_path / "run"
    _attempt(run_dir, shakespeare, monkeypatch, fail_at_call=1)  # fails before step 1
    assert [r["step"] for r in _records(run_dir)] == [0]  # its step-0 validation
    first_events = _event_files(run_dir)
    assert len(first_events) == 1 and not (run_dir / "checkpoints").exists()

    _attempt(run_dir, shakespeare, monkeypatch, fail_at_call=4)  # step 2 saved, step 3 logged
    output = capsys.readouterr().out
    assert f"{run_dir}: dropped what an earlier attempt logged without saving a checkpoint " \
           "(1 metrics.jsonl record(s), 1 TensorBoard event file(s))" in output
    assert [r["step"] for r in _records(run_dir) if "val/loss" in r] == [0]
    assert max(r["step"] for r in _records(run_dir)) == 3
    assert first_events[0] not in _event_files(run_dir)

    summary = _attempt(run_dir, shakespeare, monkeypatch)  # resumes from step 2
    assert summary.start_step == 2 and summary.final_step == 4
    assert f"dropped what an earlier attempt logged after step 2, its checkpoint " \
           "(1 metrics.jsonl record(s))" in capsys.readouterr().out
    losses = [r["step"] for r in _records(run_dir) if "train/loss" in r]
    assert losses == [1, 2, 3, 4]  # step 3 of the failed attempt is gone, once each
    assert [r["step"] for r in _records(run_dir) if "val/loss" in r] == [0, 4]
    assert len(_event_files(run_dir)) == 2  # the resumed attempt's; TensorBoard purges step 3
