"""``train.lr_decay_style``: each style's LR curve against its formula written out here, a
resumed schedule continuing exactly (mid-stable and mid-decay), the checkpoint's WSD decay
kept on resume, and the milestones ``t2train plan`` prints. Megatron's scheduler on a
one-parameter optimizer, built by the engines' ``lr_scheduler``; no training."""

from __future__ import annotations

import math

import pytest
import torch

from t2train.config.loader import load_config
from t2train.config.lr_schedule import configured_lr_schedule
from t2train.engine.shared import lr_scheduler

LR, MIN_LR, WARMUP, STEPS = 1e-3, 1e-4, 10, 100
FRACTION = 0.3  # WSD: stable until step 70, decay over steps 71-100
WSD_SHAPES = ["linear", "cosine", "exponential", "minus_sqrt"]
STYLES = [(style, "linear") for style in ("cosine", "linear", "constant")] + [
    ("wsd", shape) for shape in WSD_SHAPES
]


def _config(style: str, shape: str = "linear", *more: str):
    return load_config(
        overrides=[
            "data.path=/some/data",
            f"train.steps={STEPS}",
            f"train.lr={LR}",
            f"train.min_lr={MIN_LR}",
            f"train.warmup_steps={WARMUP}",
            f"train.lr_decay_style={style}",
            f"train.lr_wsd_decay_style={shape}",
            f"train.lr_wsd_decay_fraction={FRACTION}",
            *more,
        ]
    )


def _scheduler(config):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return lr_scheduler(optimizer, config)


def _lrs(scheduler, steps: int) -> list[float]:
    """The LR now, then after each of ``steps`` updates (as train/lr is logged)."""
    lrs = [scheduler.optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        scheduler.step(increment=1)
        lrs.append(scheduler.optimizer.param_groups[0]["lr"])
    return lrs


def expected_lr(style: str, shape: str, step: int, fraction: float = FRACTION) -> float:
    """Linear warm-up from 0 to LR at step WARMUP, then the style's decay to MIN_LR at STEPS."""
    if step <= WARMUP:
        return LR * step / WARMUP
    if style == "constant":
        return LR
    if style == "wsd":
        decay_steps = round(fraction * STEPS)
        stable_until = STEPS - decay_steps
        if step <= stable_until:
            return LR
        ratio = (step - stable_until) / decay_steps
        coeff = {
            "linear": 1 - ratio,
            "cosine": 0.5 * (1 + math.cos(math.pi * ratio)),
            "exponential": 2 * 0.5**ratio - 1,
            "minus_sqrt": 1 - math.sqrt(ratio),
        }[shape]
    else:
        ratio = (step - WARMUP) / (STEPS - WARMUP)
        coeff = 1 - ratio if style == "linear" else 0.5 * (1 + math.cos(math.pi * ratio))
    return MIN_LR + (LR - MIN_LR) * coeff


@pytest.mark.parametrize("style, shape", STYLES)
def test_each_style_follows_its_formula(style, shape):
    lrs = _lrs(_scheduler(_config(style, shape)), STEPS)
    for step in (0, 1, 5, 10, 11, 40, 55, 70, 71, 85, 99, 100):
        assert lrs[step] == pytest.approx(expected_lr(style, shape, step), rel=1e-12), step
    assert lrs[10] == LR and lrs[100] == (LR if style == "constant" else MIN_LR)
    if style == "wsd":  # held until the decay, halfway down at its midpoint for the linear
        assert lrs[40] == lrs[70] == LR and lrs[71] < LR
        assert shape != "linear" or lrs[85] == pytest.approx((LR + MIN_LR) / 2, rel=1e-12)
    if style == "cosine":
        assert lrs[55] == pytest.approx((LR + MIN_LR) / 2, rel=1e-12)


@pytest.mark.parametrize(
    "style, shape, resume_at",
    [(style, shape, 85) for style, shape in STYLES] + [("wsd", "cosine", 40)],  # 40: stable
)
def test_a_resumed_schedule_continues_exactly(style, shape, resume_at, tmp_path):
    """A checkpoint's scheduler state (as both engines save it) loaded into a fresh scheduler
    gives the uninterrupted run's LR at every later step, bit for bit."""
    config = _config(style, shape)
    uninterrupted = _lrs(_scheduler(config), STEPS)
    first = _scheduler(config)
    before = _lrs(first, resume_at)
    torch.save(first.state_dict(), tmp_path / "scheduler.pt")
    resumed = _scheduler(config)
    resumed.load_state_dict(torch.load(tmp_path / "scheduler.pt"))
    assert before[:-1] + _lrs(resumed, STEPS - resume_at) == uninterrupted


@pytest.mark.parametrize("choice", ["checkpoint", "config"])
def test_a_resume_follows_the_chosen_wsd_decay(choice):
    """Megatron's own state leaves the WSD decay out; t2train's keeps it, so a resumed run
    whose config changed the decay follows the checkpoint's (or, when chosen, the config's)."""
    first = _scheduler(_config("wsd", "linear"))
    _lrs(first, 40)
    changed = _config(
        "wsd", "cosine", "train.lr_wsd_decay_fraction=0.5", f"train.schedule_on_resume={choice}"
    )
    resumed = _scheduler(changed)
    resumed.load_state_dict(first.state_dict())
    followed = ("linear", FRACTION) if choice == "checkpoint" else ("cosine", 0.5)
    lrs = _lrs(resumed, STEPS - 40)
    assert lrs == pytest.approx(
        [expected_lr("wsd", followed[0], step, followed[1]) for step in range(40, STEPS + 1)],
        rel=1e-12,
    )


def test_a_checkpoint_from_before_the_styles_resumes_its_cosine():
    """Older checkpoints hold Megatron's state only (always cosine): resumed under a WSD
    config with train.schedule_on_resume=checkpoint, the cosine goes on."""
    first = _scheduler(_config("cosine"))
    _lrs(first, 60)
    old = {
        key: value
        for key, value in first.state_dict().items()
        if key not in ("wsd_decay_steps", "lr_wsd_decay_style")
    }
    resumed = _scheduler(_config("wsd"))
    resumed.load_state_dict(old)
    assert _lrs(resumed, STEPS - 60) == pytest.approx(
        [expected_lr("cosine", "linear", step) for step in range(60, STEPS + 1)], rel=1e-12
    )


@pytest.mark.parametrize(
    "style, shape, line",
    [
        (
            "cosine",
            "linear",
            "cosine, warm-up 0 -> 1.00e-03 by step 10, decay to 1.00e-04 by step 100",
        ),
        (
            "linear",
            "linear",
            "linear, warm-up 0 -> 1.00e-03 by step 10, decay to 1.00e-04 by step 100",
        ),
        (
            "constant",
            "linear",
            "constant, warm-up 0 -> 1.00e-03 by step 10, then 1.00e-03 (train.min_lr unused)",
        ),
        (
            "wsd",
            "minus_sqrt",
            "wsd, warm-up 0 -> 1.00e-03 by step 10, stable 1.00e-03 until step 70, "
            "minus_sqrt decay to 1.00e-04 by step 100",
        ),
    ],
)
def test_the_milestones_are_described(style, shape, line):
    assert configured_lr_schedule(_config(style, shape).train) == line


def test_no_warmup_is_said():
    config = _config("wsd", "linear", "train.warmup_steps=0")
    assert configured_lr_schedule(config.train).startswith("wsd, no warm-up, stable 1.00e-03")
