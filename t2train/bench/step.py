"""``t2train bench step``: step time, throughput, memory and pipeline traffic per residual design.

Every design runs in one process on the same real batches: ``--warmup`` untimed steps, then
``--steps`` timed ones (median reported). A plain-PyTorch loop of the ``standard`` model
(``reference_gpt``) runs on the same batches so the stack's own overhead is visible.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch

from t2train.bench.table import markdown_table
from t2train.residual import BASELINE

REFERENCE = f"plain PyTorch ({BASELINE})"


@dataclass
class DesignTiming:
    design: str
    params: int
    step_seconds: float  # median of the timed steps
    tokens_per_sec: float
    memory_gib: float  # peak CUDA allocation, or the process RSS on CPU
    pipeline_bytes: float  # forward + backward bytes across pipeline hops per step


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _memory_gib() -> float:
    from t2train.monitor.system import memory_gib

    memory = memory_gib()
    return memory.get("memory/peak_allocated_gib", memory["memory/rss_gib"])


def build_objects(config, vocab_size: int):
    """This rank's model, optimizer and schedule, seeded as a training run seeds them."""
    from t2train.engine.megatron.setup import build_training_objects
    from t2train.parallel.init import init_distributed, init_model_parallel, set_seed

    init_distributed()
    parallel = config.parallel
    set_seed(config.train.seed, init_model_parallel(parallel.tensor, parallel.pipeline,
                                                    parallel.virtual_pipeline))
    return build_training_objects(config, vocab_size)


def time_design(config, vocab_size: int, steps: list, warmup: int,
                variant: str) -> DesignTiming:
    from t2train.engine.megatron.step import train_step
    from t2train.model.flops import parameters

    objs = build_objects(config, vocab_size)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for index, micro_batches in enumerate(steps):
        _synchronize()
        started = time.perf_counter()
        result = train_step(objs, micro_batches)
        _synchronize()
        if index >= warmup:
            seconds.append(time.perf_counter() - started)
    median = statistics.median(seconds)
    traffic = result.traffic
    timing = DesignTiming(
        design=variant, params=parameters(config.model, vocab_size),
        step_seconds=median, tokens_per_sec=_tokens_per_step(config) / median,
        memory_gib=_memory_gib(),
        pipeline_bytes=traffic["pipeline/forward_bytes"] + traffic["pipeline/backward_bytes"])
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return timing


def model_vocab_size(config) -> int:
    """The dataset's (or the config's larger) vocabulary, padded as Megatron pads it."""
    from t2train.model.build import padded_vocab_size
    from t2train.train.loop import dataset_facts

    return padded_vocab_size(dataset_facts(config)["vocab_size"], config)


def _tokens_per_step(config) -> int:
    return config.train.global_batch_size * config.model.seq_length


def real_batches(config, count: int) -> list:
    """``count`` steps' micro-batches from the train split, read once and reused per design."""
    import torch.distributed as dist

    from t2train.parallel.init import init_distributed, init_model_parallel
    from t2train.train.batches import GlobalBatchFeeder
    from t2train.train.data import open_streams

    init_distributed()
    dp_size = config.validate_world(dist.get_world_size())
    parallel = config.parallel
    topology = init_model_parallel(parallel.tensor, parallel.pipeline, parallel.virtual_pipeline)
    train = config.train
    streams = open_streams(config, topology, dp_size, None)
    feeder = GlobalBatchFeeder(streams.train, config.micro_batches_per_step(dp_size),
                               train.micro_batch_size, config.model.seq_length)
    return [feeder.next_step() for _ in range(count)]


def reference_timing(config, vocab_size: int, steps: list, warmup: int) -> DesignTiming:
    from t2train.bench.reference_gpt import time_reference_steps
    from t2train.model.build import compute_dtype
    from t2train.model.flops import standard_parameters

    torch.manual_seed(config.train.seed)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    median = statistics.median(time_reference_steps(config, vocab_size, steps, warmup,
                                                    compute_dtype(config)))
    return DesignTiming(REFERENCE, standard_parameters(config.model, vocab_size), median,
                        _tokens_per_step(config) / median, _memory_gib(), 0.0)


def run_step_bench(preset: Optional[str], config_file: Optional[str], overrides: list[str],
                   designs: list[str], warmup: int, steps: int) -> list[DesignTiming]:
    """One timing per design, plus the plain-PyTorch reference when the world is one rank."""
    import torch.distributed as dist

    from t2train.bench.variants import variant_config

    configs = [variant_config(preset, config_file, overrides, design) for design in designs]
    vocab_size = model_vocab_size(configs[0])
    batches = real_batches(configs[0], warmup + steps)
    timings = [time_design(config, vocab_size, batches, warmup, design)
               for config, design in zip(configs, designs, strict=True)]
    if dist.get_world_size() == 1:
        timings.append(reference_timing(configs[0], vocab_size, batches, warmup))
    return timings


def format_step_table(timings: list[DesignTiming]) -> str:
    by_design = {timing.design: timing for timing in timings}
    baseline = by_design.get(BASELINE)
    memory = "peak CUDA memory (GiB)" if torch.cuda.is_available() else "process RSS (GiB)"
    headers = ["design", "params (M)", "step time (ms, median)", f"vs {BASELINE}", "tokens/s",
               memory, "pipeline bytes/step"]
    rows = [[timing.design, f"{timing.params / 1e6:.2f}", f"{timing.step_seconds * 1e3:.1f}",
             f"{timing.step_seconds / baseline.step_seconds:.2f}" if baseline else "n/a",
             f"{timing.tokens_per_sec:.0f}", f"{timing.memory_gib:.2f}",
             f"{timing.pipeline_bytes:.0f}"] for timing in timings]
    table = markdown_table(headers, rows)
    reference = by_design.get(REFERENCE)
    if baseline and reference:
        table += (f"\n\nstack overhead: t2train `standard` runs at "
                  f"{baseline.tokens_per_sec / reference.tokens_per_sec:.2f}x the tokens/s of "
                  f"the plain-PyTorch loop")
    return table


def _cmd_step(args) -> int:
    from t2train.bench.variants import variant_names
    from t2train.parallel.init import is_rank_zero

    designs = variant_names(args.designs)
    timings = run_step_bench(args.preset, args.config, args.overrides, designs, args.warmup,
                             args.steps)
    if is_rank_zero():
        print(format_step_table(timings))
    return 0


def register(commands) -> None:
    from t2train.config.arguments import add_config_arguments

    bench = commands.add_parser("bench", help="benchmarks")
    tools = bench.add_subparsers(dest="bench_command", required=True)
    step = tools.add_parser(
        "step", help="step time, tokens/s, memory, pipeline bytes per residual design",
        description="Time training steps of each residual design at the configured layout on "
                    "real batches, against standard and a plain-PyTorch loop.")
    add_config_arguments(step)
    step.add_argument("--designs", help="comma-separated designs, each alone or with the "
                                        "local mixer: ddl,ddl+shortswa (default: every "
                                        "registered design alone)")
    step.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    step.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    step.set_defaults(handler=_cmd_step)
