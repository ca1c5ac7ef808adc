"""``t2train bench step``: step time, throughput, memory and pipeline traffic per residual design.

Every design runs in one process on the same real batches: ``--warmup`` untimed steps, then
``--steps`` timed ones, ``--repeats`` times with the designs taking turns, so a change of the
machine's load affects them alike; the table gives the minimum and the median over all timed
steps, and the load average before and after. A plain-PyTorch loop of the ``standard`` model
(``reference_gpt``) runs on the same batches so the stack's own overhead is visible; when the
fused path is on (``model.fusions``), also with its blocks and its loss compiled (in this
process, after the designs: the GPU check times it in a process of its own). The warm-up
steps' time, where compilation happens, is reported apart from the step time.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Optional

from t2train.bench.table import markdown_table
from t2train.residual import BASELINE

REFERENCE = f"plain PyTorch ({BASELINE})"
# The blocks and the loss compiled (reference_gpt.py); "compiled blocks" in reports before
# 2026-12 named a weaker loop (RoPE's tables rebuilt in every block, fp32 logits).
COMPILED_REFERENCE = f"plain PyTorch, compiled ({BASELINE})"


@dataclass
class DesignTiming:
    design: str
    params: int
    step_samples: list  # seconds of every timed step
    tokens_per_step: int
    memory_gib: float  # peak CUDA allocation, or the process RSS on CPU
    traffic: dict  # the last step's pipeline/<...> counters (empty without a pipeline)
    warmup_seconds: float = 0.0  # the untimed steps before, compilation included
    warmup_samples: list = field(default_factory=list)  # seconds of each of them

    @property
    def step_seconds(self) -> float:
        return statistics.median(self.step_samples)

    @property
    def step_seconds_min(self) -> float:
        return min(self.step_samples)

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens_per_step / self.step_seconds

    def pipeline_bytes(self, kind: str) -> float:
        """Forward + backward ``data`` or ``wire`` bytes across pipeline hops per step."""
        return sum(
            self.traffic.get(f"pipeline/{direction}_{kind}_bytes", 0.0)
            for direction in ("forward", "backward")
        )

    def merged(self, later: "DesignTiming") -> "DesignTiming":
        """This timing and a later repetition's, as one."""
        return replace(
            later,
            step_samples=self.step_samples + later.step_samples,
            memory_gib=max(self.memory_gib, later.memory_gib),
            warmup_seconds=max(self.warmup_seconds, later.warmup_seconds),
        )


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _memory_gib() -> float:
    from t2train.monitor.system import memory_gib

    memory = memory_gib()
    return memory.get("memory/peak_allocated_gib", memory["memory/rss_gib"])


def build_objects(config, vocab_size: int):
    """This rank's model, optimizer and schedule, seeded as a training run seeds them.

    Compiled code of models built before is dropped: each variant's fused path compiles in
    its own warm-up, and one process timing many designs stays under dynamo's recompile limit
    (designs share the layer's code)."""
    import torch

    from t2train.engine.megatron.setup import build_training_objects
    from t2train.parallel.init import init_distributed, init_model_parallel, set_seed

    torch._dynamo.reset()
    init_distributed()
    parallel = config.parallel
    set_seed(
        config.train.seed,
        init_model_parallel(parallel.tensor, parallel.pipeline, parallel.virtual_pipeline),
    )
    return build_training_objects(config, vocab_size)


def time_design(config, vocab_size: int, steps: list, warmup: int, variant: str) -> DesignTiming:
    import torch

    from t2train.engine.megatron.step import train_step
    from t2train.model.flops import parameters

    objs = build_objects(config, vocab_size)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for micro_batches in steps:
        _synchronize()
        started = time.perf_counter()
        result = train_step(objs, micro_batches)
        _synchronize()
        seconds.append(time.perf_counter() - started)
    timing = DesignTiming(
        design=variant,
        params=parameters(config.model, vocab_size),
        step_samples=seconds[warmup:],
        tokens_per_step=_tokens_per_step(config),
        memory_gib=_memory_gib(),
        traffic=result.traffic,
        warmup_seconds=sum(seconds[:warmup]),
        warmup_samples=seconds[:warmup],
    )
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return timing


def model_vocab_size(config) -> int:
    """The dataset's (or the config's larger) vocabulary, padded as Megatron pads it."""
    from t2train.train.inputs import dataset_facts

    return config.padded_vocab_size(dataset_facts(config)["vocab_size"])


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
    feeder = GlobalBatchFeeder(
        streams.train,
        config.micro_batches_per_step(dp_size),
        train.micro_batch_size,
        config.model.seq_length,
    )
    return [feeder.next_step() for _ in range(count)]


def reference_setup(config, vocab_size: int):
    """The reference's shape and training settings for ``config`` (the ``standard`` model)."""
    from t2train.bench.reference_gpt import ReferenceShape, ReferenceTraining
    from t2train.model.build import compute_dtype

    return (
        ReferenceShape.of(config.model, vocab_size),
        ReferenceTraining.of(config.train, compute_dtype(config)),
    )


def reference_design_timing(
    config, compiled: bool, seconds: list, warmup: int, memory_gib: float, params: int
) -> DesignTiming:
    return DesignTiming(
        COMPILED_REFERENCE if compiled else REFERENCE,
        params,
        seconds[warmup:],
        _tokens_per_step(config),
        memory_gib,
        {},
        warmup_seconds=sum(seconds[:warmup]),
        warmup_samples=seconds[:warmup],
    )


def reference_timing(
    config, vocab_size: int, steps: list, warmup: int, compiled: bool = False
) -> DesignTiming:
    """The plain-PyTorch loop in this process, eager or compiled (its blocks and its loss,
    with the fused path's backend). The GPU check times it in a fresh process instead
    (``tools/gpu_check/perf.py``)."""
    import torch

    from t2train.bench.reference_gpt import count_parameters, time_reference_steps
    from t2train.nn.compiling import compile_backend

    shape, training = reference_setup(config, vocab_size)
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    seconds = time_reference_steps(
        shape, training, steps, warmup, backend=compile_backend() if compiled else None
    )
    return reference_design_timing(
        config, compiled, seconds, warmup, _memory_gib(), count_parameters(shape)
    )


def run_step_bench(
    preset: Optional[str],
    config_file: Optional[str],
    overrides: list[str],
    designs: list[str],
    warmup: int,
    steps: int,
    repeats: int = 1,
) -> list[DesignTiming]:
    """One timing per design, plus the plain-PyTorch reference when the world is one rank
    (and its compiled twin when the fused path is on); ``repeats`` rounds in which every
    design takes its turn."""
    import torch.distributed as dist

    from t2train.bench.variants import variant_config
    from t2train.model.build import fusions_on

    configs = [variant_config(preset, config_file, overrides, design) for design in designs]
    vocab_size = model_vocab_size(configs[0])
    batches = real_batches(configs[0], warmup + steps)
    reference = dist.get_world_size() == 1
    timings: list[DesignTiming] = []
    for _ in range(repeats):
        round_ = [
            time_design(config, vocab_size, batches, warmup, design)
            for config, design in zip(configs, designs, strict=True)
        ]
        if reference:
            round_.append(reference_timing(configs[0], vocab_size, batches, warmup))
            if fusions_on(configs[0]):
                round_.append(
                    reference_timing(configs[0], vocab_size, batches, warmup, compiled=True)
                )
        timings = (
            round_
            if not timings
            else [earlier.merged(later) for earlier, later in zip(timings, round_)]
        )
    return timings


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min) on {os.cpu_count()} CPUs"


def format_step_table(timings: list[DesignTiming]) -> str:
    import torch

    by_design = {timing.design: timing for timing in timings}
    baseline = by_design.get(BASELINE)
    memory = "peak CUDA memory (GiB)" if torch.cuda.is_available() else "process RSS (GiB)"
    headers = [
        "design",
        "params (M)",
        "step time (ms, min)",
        "step time (ms, median)",
        f"vs {BASELINE} (median)",
        "tokens/s (median)",
        memory,
        "pipeline data bytes/step",
        "pipeline wire bytes/step",
        "warm-up (s)",
    ]
    rows = [
        [
            timing.design,
            f"{timing.params / 1e6:.2f}",
            f"{timing.step_seconds_min * 1e3:.1f}",
            f"{timing.step_seconds * 1e3:.1f}",
            f"{timing.step_seconds / baseline.step_seconds:.2f}" if baseline else "n/a",
            f"{timing.tokens_per_sec:.0f}",
            f"{timing.memory_gib:.2f}",
            f"{timing.pipeline_bytes('data'):.0f}",
            f"{timing.pipeline_bytes('wire'):.0f}",
            f"{timing.warmup_seconds:.1f}",
        ]
        for timing in timings
    ]
    table = markdown_table(headers, rows)
    samples = {len(timing.step_samples) for timing in timings}
    table += (
        f"\n\n{'/'.join(str(n) for n in sorted(samples))} timed steps per design; "
        "pipeline bytes: forward + backward of one step, summed over ranks (data: the "
        "units each receiver lacked; wire: as sent, zero padding included); warm-up: the "
        "untimed steps before them, compilation included (fused path)"
    )
    for name, loop in (
        (REFERENCE, "plain-PyTorch loop"),
        (COMPILED_REFERENCE, "plain-PyTorch loop with its blocks and loss compiled"),
    ):
        reference = by_design.get(name)
        if baseline and reference:
            table += (
                f"\nstack overhead: t2train `{BASELINE}` runs at "
                f"{baseline.tokens_per_sec / reference.tokens_per_sec:.2f}x the tokens/s "
                f"of the {loop}"
            )
    return table


def _cmd_step(args) -> int:
    from t2train.bench.variants import variant_names
    from t2train.parallel.init import is_rank_zero

    designs = variant_names(args.designs)
    before = load_average()
    timings = run_step_bench(
        args.preset, args.config, args.overrides, designs, args.warmup, args.steps, args.repeats
    )
    if is_rank_zero():
        print(format_step_table(timings))
        print(f"load average before: {before}; after: {load_average()}")
    return 0


def register(commands) -> None:
    from t2train.bench.byte_account import register as register_bytes
    from t2train.bench.kernels import register as register_kernels
    from t2train.config.arguments import add_config_arguments

    bench = commands.add_parser("bench", help="benchmarks")
    tools = bench.add_subparsers(dest="bench_command", required=True)
    step = tools.add_parser(
        "step",
        help="step time, tokens/s, memory, pipeline bytes per residual design",
        description="Time training steps of each residual design at the configured layout on "
        "real batches, against the baseline design and a plain-PyTorch loop.",
    )
    add_config_arguments(step)
    step.add_argument(
        "--designs",
        help="comma-separated designs, each alone or with the "
        "local mixer: <design> or <design>+<mixer> (default: "
        "every registered design alone)",
    )
    step.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    step.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    step.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every design, taking turns (default 1); min and median "
        "are over all timed steps",
    )
    step.set_defaults(handler=_cmd_step)
    register_bytes(tools)
    register_kernels(tools)
