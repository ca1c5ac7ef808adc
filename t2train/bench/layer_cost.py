"""Each residual design's decoder layers against the baseline design's: the design's extra
time and memory per layer, with everything else (embedding, output layer, loss, optimizer)
left out.

A variant's decoder (its layers, the stream's entry and exit, the final norm) is built as
the trainer builds it (``build_model_chunks``: the fused path compiled per layer where the
config turns it on) at one micro-batch of a preset, and timed forward+backward on a random
input; the time per layer is the decoder's over its layer count. The peak memory is what the
decoder's forward+backward allocates beyond the weights (CUDA only). Ratios are against the
baseline design (``t2train.residual.BASELINE``) of the same preset and run.

On the CPU (the kernel benchmark's dry run) it only proves the harness runs.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass
from typing import Iterable, Optional

import torch

from t2train.bench.kernel_cases import bench_ms
from t2train.kernels.benchmark import Runtime
from t2train.residual import BASELINE

TABLE_HEADER = [
    "variant",
    "preset",
    "layers",
    "ms per layer (fwd+bwd)",
    f"vs {BASELINE}",
    "peak MiB (fwd+bwd)",
    f"memory vs {BASELINE}",
]


@dataclass
class LayerCost:
    variant: str
    preset: str
    layers: int
    ms_per_layer: Optional[float]  # None: the variant failed
    peak_mib: Optional[float]  # beyond the weights; None on the CPU
    vs_baseline: Optional[float] = None  # this variant's time / the baseline's
    memory_vs_baseline: Optional[float] = None
    error: str = ""


def _decoder_cost(config, rt: Runtime) -> tuple[float, Optional[float]]:
    """(ms per layer, peak MiB beyond the weights) of one variant's one-stage decoder."""
    from t2train.model.build import build_model_chunks, transformer_config
    from t2train.parallel.init import one_process_world

    one_process_world()
    torch._dynamo.reset()  # each variant compiles its own layers, within the recompile limit
    tf_config = transformer_config(config)
    tf_config.params_dtype = rt.dtype
    torch.manual_seed(0)
    [model] = build_model_chunks(config, tf_config, vocab_size=128)
    model.to(device=rt.device, dtype=rt.dtype)
    hidden = rt.leaf(
        config.model.seq_length, config.train.micro_batch_size, config.model.hidden_size
    )
    grad = torch.randn_like(hidden)

    def step():
        model.decode(hidden).backward(grad)

    step()  # compiles
    if rt.on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak: Optional[float] = (torch.cuda.max_memory_allocated() - before) / 2**20
    else:
        peak = None
    ms = bench_ms(rt, step, [hidden, *model.parameters()]) / config.model.num_layers
    return ms, peak


def layer_costs(
    label: str, preset: str, overrides: Iterable[str], variants: Iterable[str], rt: Runtime
) -> list[LayerCost]:
    """The baseline's decoder and each variant's, at one micro-batch of ``preset``."""
    from t2train.bench.variants import variant_config

    variants = [BASELINE, *(v for v in variants if v != BASELINE)]
    costs = []
    for variant in variants:
        config = variant_config(preset, None, ["data.path=unused", *overrides], variant)
        cost = LayerCost(variant, label, config.model.num_layers, None, None)
        try:
            cost.ms_per_layer, cost.peak_mib = _decoder_cost(config, rt)
        except Exception as err:  # reported in its row; the other variants still run
            cost.error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:120]}"
        costs.append(cost)
        gc.collect()
        if rt.on_cuda:
            torch.cuda.empty_cache()
    baseline = costs[0]
    for cost in costs:
        if cost.ms_per_layer is not None and baseline.ms_per_layer:
            cost.vs_baseline = cost.ms_per_layer / baseline.ms_per_layer
        if cost.peak_mib is not None and baseline.peak_mib:
            cost.memory_vs_baseline = cost.peak_mib / baseline.peak_mib
    return costs


def table_cells(cost: LayerCost) -> list[str]:
    if cost.ms_per_layer is None:
        return [cost.variant, cost.preset, str(cost.layers), f"failed: {cost.error}", "", "", ""]

    def ratio(value: Optional[float]) -> str:
        return f"{value:.2f}x" if value is not None else ""

    return [
        cost.variant,
        cost.preset,
        str(cost.layers),
        f"{cost.ms_per_layer:.3f}",
        ratio(cost.vs_baseline),
        f"{cost.peak_mib:.0f}" if cost.peak_mib is not None else "",
        ratio(cost.memory_vs_baseline),
    ]


def row_dict(cost: LayerCost) -> dict:
    return asdict(cost)
