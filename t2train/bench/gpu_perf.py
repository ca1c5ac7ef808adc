"""GPU check, performance: step cost of every design variant, and MFU of the MFU preset.

Both time real training steps through ``t2train bench step``'s code (``time_design``): the
same pre-read batches for every variant, warm-up steps untimed, the median of the timed ones.
"""

from __future__ import annotations

import time

from t2train.bench.gpu_plan import Plan, Variant, step_variants


def _config(plan: Plan, preset: str, overrides: tuple, variant: Variant):
    from t2train.config.loader import load_config

    return load_config(preset, None, [f"data.path={plan.data}", *overrides, *variant.overrides])


def _timing_item(name: str, timing, **extra) -> dict:
    return dict(extra, name=name, params=timing.params, step_ms=timing.step_seconds * 1e3,
                tokens_per_s=timing.tokens_per_sec, memory_gib=timing.memory_gib)


def _timed(section, name: str, measure, estimate: float, **extra) -> None:
    """Run ``measure()`` if it fits the section's time, else record why it was skipped."""
    if not section.fits(estimate):
        section.add(dict(extra, name=name, status="skipped", reason=section.no_time(estimate)))
        return
    started = time.monotonic()
    try:
        item = dict(_timing_item(name, measure(), **extra), status="ok")
    except Exception as err:  # noqa: BLE001 - reported; the other variants still run
        item = dict(extra, name=name, status="error", reason=f"{type(err).__name__}: {err}")
    section.add(dict(item, seconds=time.monotonic() - started))


def step_cost(section, plan: Plan) -> None:
    from t2train.bench.step import (REFERENCE, model_vocab_size, real_batches, reference_timing,
                                    time_design)
    from t2train.residual import registered

    variants = step_variants(plan.targets, registered())
    configs = [_config(plan, plan.step_preset, plan.step_overrides, v) for v in variants]
    vocab = model_vocab_size(configs[0])
    section.data.update(preset=plan.step_preset, overrides=plan.step_overrides,
                        warmup=plan.step_warmup, steps=plan.step_steps,
                        tokens_per_step=configs[0].train.global_batch_size *
                        configs[0].model.seq_length)
    batches = real_batches(configs[0], plan.step_warmup + plan.step_steps)
    for variant, config in zip(variants, configs):
        _timed(section, variant.name,
               lambda config=config: time_design(config, vocab, batches, plan.step_warmup),
               section.last_item_seconds(default=30.0), overrides=variant.overrides,
               max_ratio=variant.max_ratio)
    _timed(section, REFERENCE,
           lambda: reference_timing(configs[0], vocab, batches, plan.step_warmup),
           section.last_item_seconds(default=30.0), overrides=(), reference=True)


def mfu(section, plan: Plan) -> None:
    import torch

    from t2train.bench.step import (REFERENCE, model_vocab_size, real_batches, reference_timing,
                                    time_design)
    from t2train.model.build import compute_dtype
    from t2train.monitor.mfu import model_flops_per_token, peak_tflops

    variant = plan.targets.mfu_variant
    config = _config(plan, plan.mfu_preset, plan.mfu_overrides, variant)
    vocab = model_vocab_size(config)
    dtype = compute_dtype(config)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    section.data.update(
        preset=plan.mfu_preset, overrides=plan.mfu_overrides, warmup=plan.mfu_warmup,
        steps=plan.mfu_steps, precision=str(dtype).removeprefix("torch."),
        flops_per_token=model_flops_per_token(config.model, vocab),
        datasheet_tflops=peak_tflops(device, dtype) if device else None)
    batches = real_batches(config, plan.mfu_warmup + plan.mfu_steps)
    _timed(section, variant.name, lambda: time_design(config, vocab, batches, plan.mfu_warmup),
           60.0, overrides=variant.overrides)
    _timed(section, REFERENCE, lambda: reference_timing(config, vocab, batches, plan.mfu_warmup),
           section.last_item_seconds(default=60.0), overrides=(), reference=True)
