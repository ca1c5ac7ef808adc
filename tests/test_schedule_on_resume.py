"""``train.schedule_on_resume``: a run resumed with more ``train.steps`` follows the LR
schedule of the checkpoint or of its config, as chosen, and says which (in-process, one
rank). The learning rates are checked against Megatron's cosine formula of that horizon; a
WSD run resumed mid-stable keeps its checkpoint's decay."""

from __future__ import annotations

import json
import math

import pytest

from t2train.config.loader import load_config
from t2train.engine.megatron import MegatronEngine
from t2train.train.loop import train

pytestmark = pytest.mark.slow

LR, MIN_LR, WARMUP = 3e-3, 3e-4, 1
RUN = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    f"train.lr={LR}",
    f"train.min_lr={MIN_LR}",
    f"train.warmup_steps={WARMUP}",
    "train.eval_batches=1",
    "train.eval_interval=100",
    "train.log_interval=1",
    "log.diagnostics_interval=0",
    "log.tensorboard=false",
]


def cosine_lr(step: int, horizon: int) -> float:
    """Megatron's OptimizerParamScheduler after ``step`` updates: linear warm-up, then cosine
    from LR to MIN_LR until ``horizon``, MIN_LR after it."""
    if step <= WARMUP:
        return LR * step / WARMUP
    if step > horizon:
        return MIN_LR
    ratio = (step - WARMUP) / (horizon - WARMUP)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (math.cos(math.pi * ratio) + 1)


def _run(data, run_dir, monkeypatch, *overrides) -> tuple[dict, list]:
    """Train; returns {step: logged train/lr} and the LR each step's update used."""
    used, real_step = [], MegatronEngine.train_step

    def train_step(engine, micro_batches):
        used.append(engine.objs.optimizer.param_groups[0]["lr"])
        return real_step(engine, micro_batches)

    monkeypatch.setattr(MegatronEngine, "train_step", train_step)
    train(load_config(overrides=[*RUN, f"data.path={data}", f"log.run_dir={run_dir}", *overrides]))
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["train/lr"] for r in records if "train/lr" in r}, used


def test_the_schedule_on_resume_is_the_chosen_one(
    megatron_world, shakespeare, tmp_path, monkeypatch, capsys
):
    logged, _ = _run(shakespeare, tmp_path / "first", monkeypatch, "train.steps=4")
    assert logged == pytest.approx({s: cosine_lr(s, 4) for s in range(1, 5)}, rel=1e-6)
    checkpoint = tmp_path / "first" / "checkpoints" / "step_00000004"
    capsys.readouterr()

    for choice, horizon in (("checkpoint", 4), ("config", 8)):
        logged, used = _run(
            shakespeare,
            tmp_path / choice,
            monkeypatch,
            "train.steps=8",
            f"checkpoint.resume={checkpoint}",
            f"train.schedule_on_resume={choice}",
        )
        assert logged == pytest.approx({s: cosine_lr(s, horizon) for s in range(5, 9)}, rel=1e-6), (
            choice
        )
        assert used[0] == pytest.approx(cosine_lr(4, horizon), rel=1e-6)  # the first update
        banner = capsys.readouterr().out.splitlines()[0]
        assert (
            f"LR schedule of the {choice} (train.schedule_on_resume={choice}): cosine, "
            f"warm-up 0 -> 3.00e-03 by step 1, decay to 3.00e-04 by step {horizon}"
        ) in banner, banner
        assert (
            "this config's (cosine, warm-up 0 -> 3.00e-03 by step 1, decay to 3.00e-04 by "
            "step 8) is not used" in banner
        ) == (choice == "checkpoint"), banner
    assert cosine_lr(5, 4) != pytest.approx(cosine_lr(5, 8))  # the choice is visible


def test_a_wsd_run_resumed_mid_stable_keeps_its_decay(
    megatron_world, shakespeare, tmp_path, monkeypatch, capsys
):
    """The checkpoint holds the WSD decay (Megatron's scheduler state leaves it out): resumed
    at step 4 of 8, while stable, with another decay configured, the LRs equal the
    uninterrupted run's."""
    wsd = ["train.steps=8", "train.lr_decay_style=wsd", "train.lr_wsd_decay_fraction=0.25"]
    whole, _ = _run(shakespeare, tmp_path / "whole", monkeypatch, *wsd, "checkpoint.interval=4")
    assert whole[4] == whole[6] == LR and MIN_LR < whole[7] < LR and whole[8] == MIN_LR
    capsys.readouterr()
    resumed, _ = _run(
        shakespeare,
        tmp_path / "resumed",
        monkeypatch,
        *wsd,
        "train.lr_wsd_decay_fraction=0.5",
        "train.lr_wsd_decay_style=cosine",
        f"checkpoint.resume={tmp_path / 'whole' / 'checkpoints' / 'step_00000004'}",
    )
    assert resumed == {step: whole[step] for step in range(5, 9)}
    banner = capsys.readouterr().out.splitlines()[0]
    assert (
        "wsd, warm-up 0 -> 3.00e-03 by step 1, stable 3.00e-03 until step 6, linear decay to "
        "3.00e-04 by step 8; this config's (wsd, warm-up 0 -> 3.00e-03 by step 1, stable "
        "3.00e-03 until step 4, cosine decay to 3.00e-04 by step 8) is not used"
    ) in banner, banner
