"""GPU check, performance: step cost of every design variant, and MFU of the MFU preset.

Both time real training steps through ``t2train bench step``'s code (``time_design``): the
same pre-read batches for every variant, warm-up steps untimed (their time, compilation
included, is reported apart), the median of the timed ones. A variant is ``<design>`` or
``<design>+shortswa``, as ``t2train bench step --designs`` takes it. Beside them, the
plain-PyTorch loop, with compiled blocks and eager: the speed and memory t2train's baseline
must match.

Items run in the order of what the section must answer, so that a section short of time
drops the least needed: the baseline, then the compiled plain loop (the headline ratio),
then the eager one, then the targeted designs, then the others, then those with the mixer.
"""

from __future__ import annotations

import time

from t2train.bench.gpu.items import timing_item, variant_config
from t2train.bench.gpu.plan import Plan, baseline, mixer_variants, step_variants


def _timed(section, name: str, measure, estimate: float, **extra) -> None:
    """Run ``measure()`` if it fits the section's time, else record why it was skipped."""
    if not section.fits(estimate):
        section.add(dict(extra, name=name, status="skipped", reason=section.no_time(estimate)))
        return
    started = time.monotonic()
    try:
        item = dict(timing_item(name, measure(), **extra), status="ok")
    except Exception as err:  # reported; the other variants still run
        item = dict(extra, name=name, **section.error(err))
    section.add(dict(item, seconds=time.monotonic() - started))


def _references(section, config, vocab: int, batches: list, warmup: int) -> None:
    """The plain-PyTorch loop, with compiled blocks (the headline's reference) then eager,
    each if it fits."""
    from t2train.bench.step import COMPILED_REFERENCE, REFERENCE, reference_timing

    for name, compiled in ((COMPILED_REFERENCE, True), (REFERENCE, False)):
        _timed(
            section,
            name,
            lambda compiled=compiled: reference_timing(
                config, vocab, batches, warmup, compiled=compiled
            ),
            section.next_item_seconds(default=30.0),
            reference=True,
            compiled=compiled,
        )


def step_cost(section, plan: Plan) -> None:
    from t2train.bench.gpu.memory import judged, plan_gib
    from t2train.bench.step import model_vocab_size, real_batches, time_design
    from t2train.residual import registered

    designs = registered()
    first = variant_config(plan, plan.step_preset, plan.step_overrides, baseline())
    vocab = model_vocab_size(first)
    section.data.update(
        preset=plan.step_preset,
        overrides=plan.step_overrides,
        warmup=plan.step_warmup,
        steps=plan.step_steps,
        tokens_per_step=first.train.global_batch_size * first.model.seq_length,
    )
    batches = real_batches(first, plan.step_warmup + plan.step_steps)

    max_error = float(plan.settings.stack["memory"]["max_error"])

    def time_variant(name: str) -> None:
        config = variant_config(plan, plan.step_preset, plan.step_overrides, name)
        _timed(
            section,
            name,
            lambda: time_design(config, vocab, batches, plan.step_warmup, name),
            section.next_item_seconds(default=30.0),
            max_ratio=plan.settings.step_targets.get(name),
        )
        item = section.result["items"][-1]
        if item.get("status") == "ok":  # the planner's estimate beside the measured peak
            item.update(judged(item["memory_gib"], plan_gib(config, vocab), max_error))

    base, *others = step_variants(plan.settings, designs, plan.quick)
    time_variant(base)
    _references(section, first, vocab, batches, plan.step_warmup)
    for name in plan.items([base, *others, *mixer_variants(plan.settings, designs, plan.quick)])[
        1:
    ]:
        time_variant(name)


def mfu(section, plan: Plan) -> None:
    import torch

    from t2train.bench.step import model_vocab_size, real_batches, time_design
    from t2train.model.build import compute_dtype
    from t2train.monitor.mfu import model_flops_per_token, peak_tflops

    variant = baseline()
    config = variant_config(plan, plan.mfu_preset, plan.mfu_overrides, variant)
    vocab = model_vocab_size(config)
    dtype = compute_dtype(config)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    section.data.update(
        preset=plan.mfu_preset,
        overrides=plan.mfu_overrides,
        warmup=plan.mfu_warmup,
        steps=plan.mfu_steps,
        precision=str(dtype).removeprefix("torch."),
        flops_per_token=model_flops_per_token(config.model, vocab),
        datasheet_tflops=peak_tflops(device, dtype) if device else None,
    )
    batches = real_batches(config, plan.mfu_warmup + plan.mfu_steps)
    _timed(
        section,
        variant,
        lambda: time_design(config, vocab, batches, plan.mfu_warmup, variant),
        60.0,
    )
    _references(section, config, vocab, batches, plan.mfu_warmup)
