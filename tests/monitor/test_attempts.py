"""Several attempts in one run directory make one run (in-process, one rank):

* its metrics never mix: an attempt that failed before its first checkpoint leaves nothing
  behind for the next, and a resumed attempt drops what the failed one logged after the
  checkpoint, in metrics.jsonl and TensorBoard;
* its counters continue: skipped updates, failed saves and consumed tokens are kept in the
  checkpoint and go on from there, not from zero.
"""

from __future__ import annotations

import errno
import json
import math

import pytest
import torch

from t2train.config.loader import load_config
from t2train.engine.megatron import MegatronEngine
from t2train.train.loop import train

pytestmark = pytest.mark.slow

TINY_MODEL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.warmup_steps=1",
    "train.eval_batches=1",
    "train.log_interval=1",
]
TOKENS_PER_STEP = 8 * 64


def _attempt(run_dir, data, monkeypatch, fail_at=None, nan_at=None, failing_saves=0):
    """``t2train train`` to step 6 in this process. Its ``fail_at``-th training step raises,
    its ``nan_at``-th has a NaN gradient (the update is skipped), and its first
    ``failing_saves`` saves fail (disk full; checkpoint.on_save_error=continue)."""
    steps, saves = [], []
    real_step, real_save = MegatronEngine.train_step, MegatronEngine.save

    def train_step(engine, micro_batches):
        steps.append(1)
        if len(steps) == fail_at:
            raise RuntimeError("injected failure")
        if len(steps) == nan_at:
            weight = engine.model[0].module.decoder.layers[0].mlp.linear_fc1.weight
            handle = weight.register_hook(lambda grad: torch.full_like(grad, math.nan))
            try:
                return real_step(engine, micro_batches)
            finally:
                handle.remove()
        return real_step(engine, micro_batches)

    def save(engine, root, *args, **kwargs):
        saves.append(1)
        if len(saves) <= failing_saves:
            raise OSError(errno.ENOSPC, "No space left on device", str(root))
        return real_save(engine, root, *args, **kwargs)

    monkeypatch.setattr(MegatronEngine, "train_step", train_step)
    monkeypatch.setattr(MegatronEngine, "save", save)
    config = load_config(
        overrides=[
            *TINY_MODEL,
            f"data.path={data}",
            f"log.run_dir={run_dir}",
            "train.steps=6",
            "checkpoint.interval=2",
            "checkpoint.on_save_error=continue",
            "train.eval_interval=100",
            "log.diagnostics_interval=0",
        ]
    )
    if fail_at is None:
        return train(config)
    with pytest.raises(RuntimeError, match="injected failure"):
        train(config)


def _records(run_dir, tag=None) -> dict[int, float]:
    """step -> value of ``tag`` (each step at most once, else the test fails)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if tag in r]
    assert len(steps) == len(set(steps)), f"{tag} logged twice for a step: {steps}"
    return {r["step"]: r[tag] for r in records if tag in r}


def _event_files(run_dir) -> list:
    return sorted(run_dir.glob("events.out.tfevents.*"))


def test_attempts_in_one_run_directory_keep_one_runs_metrics_and_counters(
    megatron_world, shakespeare, tmp_path, monkeypatch, capsys
):
    run_dir = tmp_path / "run"
    _attempt(run_dir, shakespeare, monkeypatch, fail_at=1)  # fails before step 1
    assert list(_records(run_dir, "val/loss")) == [0]
    first_events = _event_files(run_dir)
    assert len(first_events) == 1 and not (run_dir / "checkpoints").exists()

    # Step 1 skipped, the step-2 save fails, step 4 is saved, step 5 logged, step 6 fails.
    _attempt(run_dir, shakespeare, monkeypatch, fail_at=6, nan_at=1, failing_saves=1)
    assert (
        f"{run_dir}: dropped what an earlier attempt logged without saving a checkpoint "
        "(1 metrics.jsonl record(s), 1 TensorBoard event file(s))" in capsys.readouterr().out
    )
    assert list(_records(run_dir, "val/loss")) == [0]
    assert first_events[0] not in _event_files(run_dir)
    assert _records(run_dir, "train/skipped_steps") == {1: 1, 2: 1, 3: 1, 4: 1, 5: 1}
    assert _records(run_dir, "checkpoint/failed_saves") == {2: 1}
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004"

    # Resumed from step 4; its save of step 6 fails too: the run's second failed save.
    summary = _attempt(run_dir, shakespeare, monkeypatch, failing_saves=1)
    assert summary.start_step == 4 and summary.final_save_failed
    assert (
        "dropped what an earlier attempt logged after step 4, its checkpoint "
        "(1 metrics.jsonl record(s))" in capsys.readouterr().out
    )
    assert list(_records(run_dir, "train/loss")) == [1, 2, 3, 4, 5, 6]  # once each
    assert list(_records(run_dir, "val/loss")) == [0, 6]
    assert len(_event_files(run_dir)) == 2  # the resumed attempt's; TensorBoard purges step 5
    assert _records(run_dir, "train/skipped_steps") == {step: 1 for step in range(1, 7)}
    assert _records(run_dir, "checkpoint/failed_saves") == {2: 1, 6: 2}
    assert _records(run_dir, "train/tokens") == {s: s * TOKENS_PER_STEP for s in range(1, 7)}
