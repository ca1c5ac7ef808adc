"""GPU check, profile: where each variant's training step spends its GPU time.

The step-cost section says how much slower a design is than the baseline; this one says in
what. ``torch.profiler`` records a few steps of each variant (the step-cost shapes and
batches, after warm-up steps) and the report lists, per variant, GPU milliseconds per step by
kind of kernel (matmuls, attention, t2train's Triton kernels, PyTorch's elementwise and
reduction kernels, copies) and its heaviest kernels. In the CPU dry run the same code ranks
CPU operators by self time.
"""

from __future__ import annotations

import re
import time

from tools.gpu_check.plan import Plan, baseline, step_variants

TOP_KERNELS = 8
# First match wins; kernel names as CUDA, cuBLAS, PyTorch and Triton spell them.
KINDS = (
    ("communication", r"nccl|c10d::|allreduce|all_gather|reduce_scatter"),
    ("copy", r"^Memcpy|^Memset|copy_kernel|CatArrayBatchedCopy"),
    ("matmul", r"gemm|cutlass|cublas|nvjet|xmma|wgmma|aten::(addmm|mm|bmm|matmul)$|Linear"),
    ("attention", r"flash|fmha|attention|sdpa|_efficient_attention"),
    ("t2train triton", r"^_(fwd|bwd|dkdv|dq|delta|phase\d|read|write|one_query)_"),
    ("torch.compile", r"^triton_"),
    ("elementwise / reduction", r"elementwise|vectorized|reduce|Reduce|unrolled|softmax|norm"),
)


def kind_of(kernel: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, kernel)), "other")


def kernel_times(prof, on_cuda: bool) -> dict:
    """Kernel (CUDA) or operator (CPU) name -> self time in microseconds, summed over steps."""
    from torch.autograd import DeviceType

    times: dict[str, float] = {}
    for event in prof.key_averages():
        if on_cuda and event.device_type == DeviceType.CUDA:
            spent = event.self_device_time_total
        elif not on_cuda:
            spent = event.self_cpu_time_total
        else:
            continue
        if spent > 0:
            times[event.key] = times.get(event.key, 0.0) + spent
    return times


def summarize(times: dict, steps: int) -> dict:
    """Per step: total ms, ms by kind of kernel, and the heaviest kernels with their share."""
    total = sum(times.values())
    kinds: dict = {}
    for kernel, spent in times.items():
        kinds[kind_of(kernel)] = kinds.get(kind_of(kernel), 0.0) + spent / steps / 1e3
    top = sorted(times.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    return {
        "ms_per_step": total / steps / 1e3,
        "kinds": dict(sorted(kinds.items(), key=lambda item: -item[1])),
        "top": [
            {
                "kernel": kernel,
                "kind": kind_of(kernel),
                "ms": spent / steps / 1e3,
                "share": spent / total,
            }
            for kernel, spent in top
        ],
    }


def profile_variant(config, vocab: int, batches: list, warmup: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from t2train.bench.step import build_objects
    from t2train.engine.megatron.step import train_step

    on_cuda = torch.cuda.is_available()
    objs = build_objects(config, vocab)
    for micro_batches in batches[:warmup]:
        train_step(objs, micro_batches)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    if on_cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for micro_batches in batches[warmup:]:
            train_step(objs, micro_batches)
        if on_cuda:
            torch.cuda.synchronize()
    del objs
    if on_cuda:
        torch.cuda.empty_cache()
    return summarize(kernel_times(prof, on_cuda), len(batches) - warmup)


def run(section, plan: Plan) -> None:
    from t2train.bench.step import model_vocab_size, real_batches
    from t2train.residual import registered
    from tools.gpu_check.items import variant_config

    first = variant_config(plan, plan.step_preset, plan.step_overrides, baseline())
    vocab = model_vocab_size(first)
    section.data.update(
        preset=plan.step_preset,
        overrides=plan.step_overrides,
        warmup=plan.profile_warmup,
        steps=plan.profile_steps,
    )
    batches = real_batches(first, plan.profile_warmup + plan.profile_steps)
    for name in plan.items(step_variants(plan.settings, registered(), plan.quick)):  # no mixer
        estimate = section.next_item_seconds(default=15.0)
        if not section.fits(estimate):
            section.add({"name": name, "status": "skipped", "reason": section.no_time(estimate)})
            continue
        started = time.monotonic()
        config = variant_config(plan, plan.step_preset, plan.step_overrides, name)
        try:
            item = dict(
                profile_variant(config, vocab, batches, plan.profile_warmup), name=name, status="ok"
            )
        except Exception as err:  # reported; the other variants still run
            item = dict(section.error(err), name=name)
        section.add(dict(item, seconds=time.monotonic() - started))
