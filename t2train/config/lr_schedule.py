"""The LR schedule's milestones in words, as ``t2train plan``, ``train --dry-run`` and the
resume line print them. Megatron's ``OptimizerParamScheduler`` computes the LRs
(``t2train/engine/shared.py``); this only describes its curve, so that ``t2train plan`` needs
no torch.

Steps are counted as ``train/lr`` is logged: the LR after that many applied updates (the one
the next update uses)."""

from __future__ import annotations

from t2train.config.schema import TrainConfig


def describe_lr_schedule(
    style: str,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    horizon: int,
    wsd_decay_steps: int,
    wsd_style: str,
) -> str:
    """``wsd, warm-up 0 -> 3.00e-03 by step 20, stable 3.00e-03 until step 160, linear decay
    to 3.00e-04 by step 200``: a style (Megatron's name or the config's) and its milestones."""
    style = style.lower()  # Megatron spells it WSD
    warmup = f"warm-up 0 -> {lr:.2e} by step {warmup_steps}" if warmup_steps else "no warm-up"
    parts = [style, warmup]
    if style == "constant":
        parts.append(f"then {lr:.2e} (train.min_lr unused)")
    elif style == "wsd":
        parts.append(f"stable {lr:.2e} until step {horizon - wsd_decay_steps}")
        parts.append(f"{wsd_style} decay to {min_lr:.2e} by step {horizon}")
    else:
        parts.append(f"decay to {min_lr:.2e} by step {horizon}")
    return ", ".join(parts)


def configured_lr_schedule(train: TrainConfig) -> str:
    """``describe_lr_schedule`` of this config's ``train`` section."""
    return describe_lr_schedule(
        train.lr_decay_style,
        train.lr,
        train.min_lr,
        train.warmup_steps,
        train.steps,
        train.wsd_decay_steps(),
        train.lr_wsd_decay_style,
    )
