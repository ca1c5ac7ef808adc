"""`t2train plan`: what a layout puts on each pipeline stage, before anything runs.

For a config and a layout (TP, PP, VPP, micro-batch, sequence length) it estimates, per
pipeline rank (one GPU of each tensor-parallel group), the memory held: parameters, their
gradients, the optimizer state, the activations of the micro-batches in flight and the depth
cache kept for them, against the device's memory; and the bytes the pipeline hops carry,
naive vs cached, as data (the units the receiver lacks) and on the wire (with the zero
padding of ``parallel.hop_shapes=padded``). Hop bytes are exact (the ``HopPlan`` is made
by ``plan_hops``, as the run's, so a run's traffic counters equal them); memory is an
estimate.

Activation memory is what each layer keeps for its backward on the fused path (every layer
compiled, as on a GPU), written out from t2train's layer in the manner of Korthikanti et al.
(arXiv 2205.05198), whose 34 s*b*h bytes describe a GPT layer with dropout and GELU: here each
sublayer keeps its input state and its RMSNorm's output (and the norm's fp32 1/rms);
attention (and the local mixer's, an attention sublayer of its own) keeps the QKV projection,
Q and K after RoPE, its output and the fp32 log-sum-exp per head (flash attention keeps no
s x s scores); SwiGLU keeps its 2f-wide projection and its f-wide product. Tensor parallelism
splits all but the states and norm outputs, which sequence parallelism splits too. The
compiled layer's saved tensors equal this count (``tests/bench/test_plan_memory.py``). Beyond
that layer, each residual design declares what its reads, writes and stream keep
(``ResidualDesign.saved_per_token``: a stream of n units, mixing weights, sources), checked
against its compiled layers the same way. Full recompute keeps each layer's input (the stream's
units, packed into one tensor: n for `hc`, every source so far for AttnRes) and, in the
backward, one layer's activations at a time; the last stage also keeps the final state
its final read takes (at most: `hc`'s mean keeps none of its n units). Selective recompute
(t2train/nn/recompute.py) keeps each layer's input (each unit once: an AttnRes source or an
earlier state is not kept again for every layer that reads it), the outputs of its GEMMs and
attention that the backward uses (QKV, attention and its fp32 log-sum-exp, the all-reduced
output projection, SwiGLU's 2f-wide fc1; the MLP's fc2 output only where the design's write
reads it again, ``ResidualDesign.selective_saved``) and, in the backward, the rest of one
layer at a time; the compiled layer keeps exactly that (checked for a design of each kind of
stream state). A design that declares no count of its own (Block AttnRes, depth_attn, DDL's
d_v > 1) is planned at what it keeps without recompute, an upper bound. The last stage holds
the logits of one micro-batch and their gradient (s*b*V/t elements each). Gradients are kept in fp32
(Megatron DDP's ``grad_reduce_in_fp32``); Adam keeps two fp32 moments, plus an fp32 master
copy of bf16 parameters, sharded over data parallelism by the distributed optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from t2train.config.lr_schedule import configured_lr_schedule
from t2train.config.schema import Config
from t2train.model.flops import extra_parameters, extra_tensor_parallel_parameters
from t2train.parallel.hop_plan import HopPlan, plan_hops
from t2train.residual import get_design, mixer_on, variant_label

# fp8 keeps bf16 parameters and activations; its GEMMs' float8 operands live for one GEMM.
ELEMENT_BYTES = {"bf16": 2, "fp32": 4, "fp8": 2}
FP32_BYTES = ELEMENT_BYTES["fp32"]  # norm and attention statistics, in any precision


@dataclass
class StagePlan:
    rank: int
    layers: list[int]  # global 0-based layer indices on this pipeline rank
    parameters: int  # on one GPU (one tensor-parallel shard)
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    depth_cache_bytes: int

    @property
    def total_bytes(self) -> int:
        return (
            self.parameter_bytes
            + self.gradient_bytes
            + self.optimizer_bytes
            + self.activation_bytes
            + self.depth_cache_bytes
        )


@dataclass
class LayoutPlan:
    tensor: int
    pipeline: int
    virtual: int
    data_parallel: int
    micro_batches: int  # per data-parallel replica
    unit_bytes: int  # one [s, b, h] unit as sent (sequence-parallel shard included)
    unit_shape: tuple[int, int, int]
    naive: HopPlan
    cached: HopPlan
    cacheable: bool  # the design has units that never change (the depth cache can skip them)
    vocab_size: int
    padded_vocab_size: int
    stages: list[StagePlan]

    def hops_in_use(self, cached: bool) -> HopPlan:
        return self.cached if cached else self.naive

    def step_bytes(self, hops: HopPlan, wire: bool) -> int:
        """Bytes all ranks send forward per step, data or on the wire (backward: as many)."""
        units = sum(hops.wire_hop_units() if wire else hops.hop_units())
        return units * self.unit_bytes * self.micro_batches * self.tensor * self.data_parallel


def _layer_parameters(config: Config, tp: int) -> tuple[int, int]:
    """(parameters per layer on one tensor rank, of which replicated), `standard` + design and
    mixer (their projections split like attention's, gates and queries are replicated)."""
    model = config.model
    h, f = model.hidden_size, model.resolved_ffn_hidden_size()
    split = extra_tensor_parallel_parameters(model)
    sharded = h * (h + 2 * model.kv_dim()) + h * h + 3 * h * f + split // model.num_layers
    replicated = 2 * h + (extra_parameters(model) - split) // model.num_layers
    return sharded // tp + replicated, replicated


def layer_bytes_per_token(model, tp: int, sequence_parallel: bool, element: int) -> float:
    """Bytes per token one layer (with the mixer when it is on) keeps for its backward on one
    tensor rank, compiled: the count of the module docstring, `standard`'s and the design's."""
    h, kv, f = model.hidden_size, model.kv_dim(), model.resolved_ffn_hidden_size()
    attention_sublayers = 2 if mixer_on(model) else 1
    sublayers = attention_sublayers + 1  # and the MLP
    states_and_norms = 2 * h * sublayers  # each sublayer's input state and normed input
    split = attention_sublayers * ((h + 2 * kv) + (h + kv) + h) + 3 * f
    inverse_rms = sublayers  # fp32, one per token and norm
    log_sum_exp = attention_sublayers * model.num_attention_heads  # fp32, per token and head
    whole = tp if sequence_parallel else 1  # what sequence parallelism splits besides
    design = get_design(model.residual).saved_per_token(model)
    return element * (
        (states_and_norms + design.whole) / whole + (split + design.split) / tp
    ) + FP32_BYTES * (
        (inverse_rms + design.whole_fp32) / whole + (log_sum_exp + design.split_fp32) / tp
    )


def selective_layer_bytes_per_token(model, tp: int, sequence_parallel: bool, element: int) -> float:
    """Bytes per token one layer keeps on one tensor rank under selective recompute, beyond
    its input state (``_selective_inputs``): the outputs of its GEMMs and attention that its
    backward uses (the module docstring), and what the design adds
    (``ResidualDesign.selective_saved``)."""
    h, kv, f = model.hidden_size, model.kv_dim(), model.resolved_ffn_hidden_size()
    attention_sublayers = 2 if mixer_on(model) else 1
    split = attention_sublayers * ((h + 2 * kv) + h) + 2 * f  # QKV, attention, SwiGLU's fc1
    projections = attention_sublayers * h  # attention's output projection, all-reduced
    log_sum_exp = attention_sublayers * model.num_attention_heads  # fp32, per token and head
    whole = tp if sequence_parallel else 1
    design = get_design(model.residual).selective_saved(model)
    return element * (
        (projections + design.whole) / whole + (split + design.split) / tp
    ) + FP32_BYTES * (design.whole_fp32 / whole + (log_sum_exp + design.split_fp32) / tp)


def _selective_inputs(hops: HopPlan, layers: list[int], final: Optional[int] = None) -> int:
    """Units a rank keeps as its layers' inputs under selective recompute: each changing
    unit, and each unchanging one (an earlier state, a source) once, not again for the next
    layer that reads it; the first layer's input is the embedding (a stream's n units are
    views of it); with ``final`` (the number of layers), the state after the last layer too
    (the final read's input)."""
    kept = 0
    previous: Optional[int] = None
    for layer in layers if final is None else [*layers, final]:
        ids = hops.unit_ids(layer)
        if layer == 0:
            kept += 1
        else:
            known = set(hops.unit_ids(previous)) if previous == layer - 1 else set()
            kept += sum(1 for uid in ids if uid is None or uid not in known)
        previous = layer
    return kept


def _in_flight(pp_rank: int, pipeline: int, virtual: int, micro_batches: int) -> int:
    """Micro-batches whose activations a rank holds at the peak of the schedule."""
    if virtual == 1:
        return min(pipeline - pp_rank, micro_batches)
    warmup = (pipeline - pp_rank - 1) * 2 + (virtual - 1) * pipeline + 1
    return min(warmup, micro_batches * virtual)


def _state_bytes(parameters: int, element: int, distributed: bool, dp: int) -> tuple[int, int]:
    """(gradient, optimizer) bytes for ``parameters`` of ``element`` bytes each."""
    master = 4 if element < 4 else 0  # an fp32 copy of low-precision parameters
    optimizer = parameters * (8 + master)
    return parameters * 4, optimizer // dp if distributed else optimizer


def plan_layout(config: Config, vocab_size: int, world_size: int) -> LayoutPlan:
    model, parallel, train = config.model, config.parallel, config.train
    dp = config.validate_world(world_size)
    tp, pp, vp = parallel.tensor, parallel.pipeline, parallel.virtual_pipeline
    micro_batches = config.micro_batches_per_step(dp)
    element = ELEMENT_BYTES[_precision_in_use(config)]
    run_hops = plan_hops(config)
    hop_plans = {cached: replace(run_hops, cached=cached) for cached in (False, True)}
    unit_shape = (run_hops.unit_rows, train.micro_batch_size, model.hidden_size)
    unit_bytes = run_hops.unit_rows * train.micro_batch_size * model.hidden_size * element
    per_chunk = run_hops.layers_per_chunk
    cacheable = any(
        uid is not None
        for layers in range(model.num_layers + 1)
        for uid in run_hops.unit_ids(layers)
    )

    vocab = config.padded_vocab_size(vocab_size)
    per_layer, _ = _layer_parameters(config, tp)
    h = model.hidden_size
    tokens = model.seq_length * train.micro_batch_size
    layer_activation = tokens * layer_bytes_per_token(
        model, tp, parallel.sequence_parallel, element
    )
    logits_bytes = 2 * tokens * vocab // tp * element
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
        if model.recompute == "full":
            # Each layer keeps its input, the stream's units packed into one tensor; the
            # backward rebuilds one layer's activations at a time.
            inputs = sum(len(run_hops.unit_ids(layer)) for layer in layers) * unit_bytes
            activations = inputs / vp * in_flight + layer_activation
            if rank == pp - 1:  # the final read's input, unpacked from the last checkpoint
                activations += len(run_hops.unit_ids(model.num_layers)) * unit_bytes
        elif model.recompute == "selective":
            # Each layer keeps its input and the outputs of its GEMMs and attention; the
            # backward rebuilds the rest of one layer at a time.
            inputs = _selective_inputs(run_hops, layers) * unit_bytes
            kept = tokens * selective_layer_bytes_per_token(
                model, tp, parallel.sequence_parallel, element
            )
            activations = (inputs / vp + kept * per_chunk) * in_flight
            activations += max(layer_activation - kept, 0)
            if rank == pp - 1:  # the final read's input: the state after the last layer
                final = _selective_inputs(run_hops, layers, model.num_layers) * unit_bytes
                activations += final - inputs
        else:
            activations = layer_activation * per_chunk * in_flight
        held_units = max(
            len(hop_plans[parallel.depth_cache == "cached"].held(c)) for c in chunk_ids
        )
        gradients, optimizer = _state_bytes(parameters, element, parallel.distributed_optimizer, dp)
        stages.append(
            StagePlan(
                rank=rank,
                layers=layers,
                parameters=parameters,
                parameter_bytes=parameters * element,
                gradient_bytes=gradients,
                optimizer_bytes=optimizer,
                activation_bytes=int(activations + (logits_bytes if rank == pp - 1 else 0)),
                depth_cache_bytes=held_units * unit_bytes * min(in_flight, micro_batches),
            )
        )
    return LayoutPlan(
        tp,
        pp,
        vp,
        dp,
        micro_batches,
        unit_bytes,
        unit_shape,
        hop_plans[False],
        hop_plans[True],
        cacheable,
        vocab_size,
        vocab,
        stages,
    )


def readable_bytes(value: float) -> str:
    """1,234 B, 12.3 KiB, ... up to TiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:,.1f} {unit}"
    return f"{value:,.0f} B"


def _units(counts: list[int]) -> str:
    return ", ".join(str(n) for n in counts)


def _hop_lines(config: Config, plan: LayoutPlan) -> list[str]:
    seq, micro, hidden = plan.unit_shape
    hops_per_step = (
        (plan.pipeline * plan.virtual - 1) * plan.micro_batches * plan.tensor * plan.data_parallel
    )
    lines = [
        f"pipeline hops: {plan.pipeline * plan.virtual - 1} per micro-batch each way, "
        f"{hops_per_step:,} per step forward over all ranks (as many backward, carrying "
        "gradients of the same size)",
        f"  a hop carries the residual-state units the next stage needs; one unit is one "
        f"[seq {seq} x micro-batch {micro} x hidden {hidden}] tensor = "
        f"{readable_bytes(plan.unit_bytes)}",
    ]
    modes = [("naive", "every unit the next stages read", False)]
    if plan.cacheable:
        modes.append(
            ("cached", "minus units the receiving rank kept from its previous chunk", True)
        )
    else:
        lines.append(
            f"  {config.model.residual}'s units all change every layer: nothing to "
            "cache, every hop is the same size"
        )
    chosen = config.parallel.caches_depth_units()
    for name, meaning, cached in modes:
        hops = plan.hops_in_use(cached)
        data, wire = plan.step_bytes(hops, wire=False), plan.step_bytes(hops, wire=True)
        in_use = (
            f"  <- in use (parallel.depth_cache={config.parallel.depth_cache})"
            if cached == chosen and plan.cacheable
            else ""
        )
        lines.append(f"  {name:>6} ({meaning}): units per hop {_units(hops.hop_units())}{in_use}")
        padding = (
            ""
            if data == wire
            else (
                f", on the wire {readable_bytes(wire)} (each hop padded to {hops.padded_units} "
                "units, parallel.hop_shapes=padded)"
            )
        )
        lines.append(f"         per step forward: data {readable_bytes(data)}{padding}")
    if plan.cacheable and plan.virtual == 1:
        lines.append(
            "  cached transfer needs virtual stages (parallel.virtual_pipeline > 1); "
            "without them it equals naive"
        )
    return lines


def _precision_in_use(config: Config) -> str:
    """``train.precision`` as the run resolves it."""
    if config.train.precision != "auto":
        return config.train.precision
    # Only a run's --dry-run plans `auto`; `t2train plan` plans a GPU's bf16 without torch.
    import torch

    return config.train.precision_on(torch.cuda.is_available())


def _precision(config: Config) -> str:
    name = {
        "bf16": "bfloat16",
        "fp32": "float32",
        "fp8": f"bfloat16 with {config.train.fp8_recipe} float8 attention and MLP GEMMs",
    }[_precision_in_use(config)]
    if config.train.precision != "auto" or name == "bfloat16":
        return name
    return f"{name} (train.precision=auto without CUDA)"


def planned_for_gpu(config: Config) -> Config:
    """``train.precision=auto`` as on a GPU (bf16), where a plan's layout runs."""
    if config.train.precision != "auto":
        return config
    return replace(config, train=replace(config.train, precision="bf16"))


def format_plan(
    config: Config,
    plan: LayoutPlan,
    vocab_source: str,
    device_bytes: Optional[int],
    precision_note: str = "",
) -> str:
    """The plan as text; each memory column is one GPU's: one tensor-parallel rank of a
    pipeline stage. Without ``device_bytes`` stages are not compared to a device."""
    model = config.model
    device = (
        ""
        if device_bytes is None
        else f"; device {readable_bytes(device_bytes)} (--device-memory-gib)"
    )
    lines = [
        f"{variant_label(model)}: {model.num_layers} layers, hidden {model.hidden_size}, seq "
        f"{model.seq_length}, micro-batch {config.train.micro_batch_size} | TP {plan.tensor} x "
        f"PP {plan.pipeline} x VPP {plan.virtual} x DP {plan.data_parallel}, "
        f"{plan.micro_batches} micro-batches per step per replica",
        f"vocabulary {plan.vocab_size:,} ({vocab_source}), padded to "
        f"{plan.padded_vocab_size:,} for tensor parallelism",
        f"lr schedule: {configured_lr_schedule(config.train)}",
        f"memory per GPU, i.e. per tensor-parallel rank of a stage (each column is one rank's "
        f"share of TP {plan.tensor}), estimated, {_precision(config)}{precision_note}{device}:",
        f"{'stage':>5}  {'layers':<12} {'params/rank':>11} {'weights':>10} {'grads':>10} "
        f"{'optimizer':>10} {'activations':>11} {'depth cache':>11} {'total':>10}",
    ]
    for stage in plan.stages:
        span = (
            ",".join(str(i) for i in stage.layers)
            if len(stage.layers) <= 4
            else f"{len(stage.layers)} of {model.num_layers}"
        )
        fits = (
            "" if device_bytes is None or stage.total_bytes <= device_bytes else "  > device memory"
        )
        lines.append(
            f"{stage.rank:>5}  {span:<12} {stage.parameters / 1e6:>10.1f}M "
            f"{readable_bytes(stage.parameter_bytes):>10} "
            f"{readable_bytes(stage.gradient_bytes):>10} "
            f"{readable_bytes(stage.optimizer_bytes):>10} "
            f"{readable_bytes(stage.activation_bytes):>11} "
            f"{readable_bytes(stage.depth_cache_bytes):>11} "
            f"{readable_bytes(stage.total_bytes):>10}{fits}"
        )
    if plan.pipeline == 1:
        lines.append("no pipeline hops (PP = 1)")
    else:
        lines.extend(_hop_lines(config, plan))
    return "\n".join(lines)
