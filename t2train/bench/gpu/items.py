"""What the timing sections share: the config a variant runs at in a check, and the fields a
timed item records (``perf.py`` for step cost and MFU, ``memory.py`` for the planner)."""

from __future__ import annotations

from t2train.bench.gpu.plan import Plan


def variant_config(plan: Plan, preset: str, overrides: tuple, variant: str):
    from t2train.bench.variants import variant_config as config_of

    return config_of(preset, None, [f"data.path={plan.data}", *overrides], variant)


def timing_item(name: str, timing, **extra) -> dict:
    return dict(
        extra,
        name=name,
        params=timing.params,
        step_ms=timing.step_seconds * 1e3,
        tokens_per_s=timing.tokens_per_sec,
        memory_gib=timing.memory_gib,
        warmup_s=timing.warmup_seconds,
    )
