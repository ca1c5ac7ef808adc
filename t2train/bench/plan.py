"""`t2train plan`: what a layout puts on each pipeline stage, before anything runs.

For a config and a layout (TP, PP, VPP, micro-batch, sequence length) it estimates, per
pipeline rank, the parameters held, the activation memory of the micro-batches in flight,
the depth cache kept for them, and the bytes each pipeline hop carries, naive vs cached.
Hop bytes are exact (the same ``HopPlan`` the decoder sends with, so a run's traffic
counters must equal them); parameters and memory are estimates.

Activation memory follows Korthikanti et al. (arXiv 2205.05198): per layer and micro-batch
s*b*h*(10 + 24/t) two-byte units without sequence parallelism and 34/t with it (the
attention-score term is absent: attention never materialises s x s here), scaled by the
element size; full recompute keeps only each layer's input state.
"""

from __future__ import annotations

from dataclasses import dataclass

from t2train.config.schema import Config
from t2train.model.build import compute_dtype, padded_vocab_size, transformer_config
from t2train.model.flops import extra_parameters, extra_tensor_parallel_parameters
from t2train.parallel.depth_cache import HopPlan
from t2train.residual import get_design, variant_label


@dataclass
class StagePlan:
    rank: int
    layers: list[int]  # global 0-based layer indices on this pipeline rank
    parameters: int
    activation_bytes: int
    depth_cache_bytes: int


@dataclass
class LayoutPlan:
    tensor: int
    pipeline: int
    virtual: int
    data_parallel: int
    micro_batches: int
    unit_bytes: int  # one [s, b, h] unit as sent (sequence-parallel shard included)
    naive: HopPlan
    cached: HopPlan
    stages: list[StagePlan]

    def hop_bytes(self, hops: HopPlan) -> int:
        """Bytes of every hop as sent: padded to the largest hop of the layout."""
        return hops.padded_units * self.unit_bytes

    def step_bytes(self, hops: HopPlan) -> int:
        """Forward bytes sent per step by all ranks (the backward sends as many)."""
        hops_per_micro_batch = (self.pipeline * self.virtual - 1) * self.tensor * \
            self.data_parallel
        return self.hop_bytes(hops) * hops_per_micro_batch * self.micro_batches


def _layer_parameters(config: Config, tp: int) -> tuple[int, int]:
    """(parameters per layer on one tensor rank, of which replicated), `standard` + design and
    mixer (their projections split like attention's, gates and queries are replicated)."""
    model = config.model
    h, f = model.hidden_size, model.resolved_ffn_hidden_size()
    split = extra_tensor_parallel_parameters(model)
    sharded = h * (h + 2 * model.kv_dim()) + h * h + 3 * h * f + split // model.num_layers
    replicated = 2 * h + (extra_parameters(model) - split) // model.num_layers
    return sharded // tp + replicated, replicated


def _in_flight(pp_rank: int, pipeline: int, virtual: int, micro_batches: int) -> int:
    """Micro-batches whose activations a rank holds at the peak of the schedule."""
    if virtual == 1:
        return min(pipeline - pp_rank, micro_batches)
    warmup = (pipeline - pp_rank - 1) * 2 + (virtual - 1) * pipeline + 1
    return min(warmup, micro_batches * virtual)


def plan_layout(config: Config, vocab_size: int, world_size: int) -> LayoutPlan:
    model, parallel, train = config.model, config.parallel, config.train
    dp = config.validate_world(world_size)
    tp, pp, vp = parallel.tensor, parallel.pipeline, parallel.virtual_pipeline
    micro_batches = config.micro_batches_per_step(dp)
    element = compute_dtype(config).itemsize
    seq = model.seq_length // tp if parallel.sequence_parallel else model.seq_length
    unit_bytes = seq * train.micro_batch_size * model.hidden_size * element
    stream = get_design(model.residual).stream(transformer_config(config), False, False, 0)
    chunks, per_chunk = pp * vp, model.num_layers // (pp * vp)
    hop_plans = {cached: HopPlan(stream.unit_ids, pp, chunks, per_chunk, cached=cached)
                 for cached in (False, True)}

    vocab = padded_vocab_size(vocab_size, config)
    per_layer, _ = _layer_parameters(config, tp)
    h = model.hidden_size
    activation_units = (34 / tp) if parallel.sequence_parallel else (10 + 24 / tp)
    per_layer_activation = model.seq_length * train.micro_batch_size * h * element / 2 \
        * activation_units
    if model.recompute == "full":
        per_layer_activation = unit_bytes
    stages = []
    for rank in range(pp):
        chunk_ids = [v * pp + rank for v in range(vp)]
        layers = [c * per_chunk + i for c in chunk_ids for i in range(per_chunk)]
        parameters = len(layers) * per_layer
        if rank == 0:
            parameters += vocab * h // tp
        if rank == pp - 1:
            parameters += h + (vocab * h // tp if (not model.tie_embeddings or pp > 1) else 0)
        in_flight = _in_flight(rank, pp, vp, micro_batches)
        held_units = max(len(hop_plans[True].held(c)) for c in chunk_ids)
        stages.append(StagePlan(
            rank=rank, layers=layers, parameters=parameters,
            activation_bytes=int(per_layer_activation * per_chunk * in_flight),
            depth_cache_bytes=held_units * unit_bytes * min(in_flight, micro_batches)))
    return LayoutPlan(tp, pp, vp, dp, micro_batches, unit_bytes, hop_plans[False],
                      hop_plans[True], stages)


def _mib(value: float) -> str:
    return f"{value / 2**20:,.1f} MiB"


def format_plan(config: Config, plan: LayoutPlan) -> str:
    model = config.model
    lines = [
        f"{variant_label(model)}: {model.num_layers} layers, hidden {model.hidden_size}, seq "
        f"{model.seq_length}, micro-batch {config.train.micro_batch_size} | TP {plan.tensor} x "
        f"PP {plan.pipeline} x VPP {plan.virtual} x DP {plan.data_parallel}, "
        f"{plan.micro_batches} micro-batches per step",
        f"{'stage':>5}  {'layers':<16} {'params/rank':>12} {'activations':>13} "
        f"{'depth cache':>12}",
    ]
    for stage in plan.stages:
        span = ",".join(str(i) for i in stage.layers) if len(stage.layers) <= 6 else \
            f"{len(stage.layers)} of {model.num_layers}"
        lines.append(f"{stage.rank:>5}  {span:<16} {stage.parameters / 1e6:>11.2f}M "
                     f"{_mib(stage.activation_bytes):>13} {_mib(stage.depth_cache_bytes):>12}")
    if plan.pipeline == 1:
        lines.append("no pipeline hops (PP = 1)")
        return "\n".join(lines)
    for name, hops in (("naive", plan.naive), ("cached", plan.cached)):
        lines.append(
            f"hops {name:>6}: units per hop {hops.hop_units()} -> sent as "
            f"{hops.padded_units} units = {_mib(plan.hop_bytes(hops))} per hop, "
            f"{_mib(plan.step_bytes(hops))} forward per step (as much backward)")
    if plan.virtual == 1:
        lines.append("cached transfer needs virtual stages (parallel.virtual_pipeline > 1); "
                     "without them it equals naive")
    return "\n".join(lines)
