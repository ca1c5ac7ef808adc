"""Non-finite losses and gradients, and loss spikes, skip the update; too many in a row stop
the run (exit code 3) with the last checkpoint intact. Faults are injected for real: NaN in
one micro-batch's activations, NaN in one weight's gradient."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from t2train.config.loader import load_config
from t2train.engine.megatron.numerics import UpdateGuard

from torchrun_helper import REPO, child_env


def _config(*overrides: str):
    return load_config(
        "tiny",
        overrides=[
            "data.path=unused",
            "model.num_layers=2",
            "model.seq_length=16",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            *overrides,
        ],
    )


def _engine():
    from t2train.engine.megatron import MegatronEngine
    from t2train.parallel.init import Topology, set_seed

    set_seed(7, Topology(0, 1, 0, 0, 0, 0, 1, 1, 1))
    return MegatronEngine(_config(), vocab_size=128)


def _batches(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(2):
        tokens = torch.randint(0, 128, (2, 17), generator=g)
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    return batches


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.model[0].module.parameters()]


def _assert_skipped_then_recovers(engine, inject, reason: str) -> None:
    engine.train_step(_batches(0))  # Adam moments exist: a NaN update would show
    before, schedule = _params(engine), engine.objs.scheduler.num_steps
    undo = inject(engine)
    result = engine.train_step(_batches(1))
    undo()
    assert result.skipped and result.skip_reason.startswith(reason), result
    assert all(torch.equal(a, b) for a, b in zip(_params(engine), before))
    assert engine.objs.scheduler.num_steps == schedule

    result = engine.train_step(_batches(2))
    assert not result.skipped and math.isfinite(result.loss)
    assert all(torch.isfinite(p).all() for p in _params(engine))
    assert not all(torch.equal(a, b) for a, b in zip(_params(engine), before))


def test_nan_gradient_skips_the_update(megatron_world):
    def nan_gradient(engine):
        weight = engine.model[0].module.decoder.layers[0].mlp.linear_fc1.weight
        return weight.register_hook(lambda grad: torch.full_like(grad, math.nan)).remove

    _assert_skipped_then_recovers(_engine(), nan_gradient, "non-finite gradients")


def test_nan_in_a_micro_batch_skips_the_update(megatron_world):
    def nan_activations(engine):
        seen = []

        def poison_first_micro_batch(module, args, output):
            seen.append(1)
            return output * math.nan if len(seen) == 1 else output

        embedding = engine.model[0].module.embedding
        return embedding.register_forward_hook(poison_first_micro_batch).remove

    _assert_skipped_then_recovers(_engine(), nan_activations, "non-finite loss (nan)")


def test_loss_spike_guard():
    guard = UpdateGuard(_config("train.loss_spike_factor=2", "train.loss_spike_window=3").train)
    assert [guard.skip_reason(loss, True) for loss in (4.0, 2.0, 3.0)] == [None] * 3
    assert guard.skip_reason(6.5, True).startswith("loss spike (6.5000 > ")
    assert guard.skip_reason(5.9, True) is None  # under 2 x mean(2, 3, 3 of the window)
    assert guard.skip_reason(1.0, False) == "non-finite gradients"
    off = UpdateGuard(_config().train)
    assert [off.skip_reason(loss, True) for loss in (1.0,) * 30 + (1e6,)] == [None] * 31


@pytest.mark.slow
def test_repeated_skips_stop_the_run_with_the_last_checkpoint_intact(shakespeare, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        str(REPO / "tests" / "workers" / "faulty_train.py"),
        "nan_gradient",
        "4",
        "--",
        "--preset",
        "tiny",
        f"data.path={shakespeare}",
        f"log.run_dir={run_dir}",
        "model.num_layers=2",
        "model.seq_length=64",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.steps=10",
        "train.warmup_steps=1",
        "train.eval_batches=1",
        "checkpoint.interval=3",
        "train.max_skipped_steps=2",
        "log.tensorboard=false",
        "log.diagnostics_interval=0",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=child_env()
    )
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step      4 | update skipped: non-finite gradients (1 in a row" in proc.stdout
    checkpoints = run_dir / "checkpoints"
    assert (
        f"error: step 5: 2 updates skipped in a row (train.max_skipped_steps=2), the last "
        f"for non-finite gradients; stopped without saving. Last checkpoint: "
        f"{checkpoints / 'step_00000003'}"
    ) in proc.stderr
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_00000003"]
    assert (checkpoints / "latest").read_text().strip() == "step_00000003"
