"""``t2train bench bytes``: the bytes each residual design moves through memory per sublayer,
counted on the CPU from the kernels the compiler makes of its layer.

A residual design is memory-bound work between GEMMs: its cost on a GPU is the bytes its
kernels read and write, which Inductor decides when it fuses a layer's operations into
kernels. This account compiles one decoder layer of a variant as the fused path does
(``model.fusions=all``, bf16, the Triton kernels as custom operators) and asks Inductor's
scheduler, after fusion, what each kernel reads and writes: every fused node and every
extern call (a GEMM, a custom operator: each a fusion barrier), in the forward and in the
backward graph. No kernel is generated or run: the layer's graphs run eagerly once, so that
both are compiled.

* **What a layer is made of here.** Each sublayer body (attention, the MLP, the mixer) is
  replaced by one GEMM: what every body's boundary costs (it reads its normed input and
  writes its output), so what is left is the design's own traffic: its reads, writes, norms
  and stream. The bodies are the same for every design.
* **Units.** One unit is a [tokens, hidden] tensor in bf16 (2 bytes a number), counted per
  sublayer call. The tokens (97, a prime) tell a tensor with a token axis from a weight by
  its size; tensors narrower than the hidden size per token (mixing weights, statistics)
  are counted in bytes per token and converted to units at ``REFERENCE_HIDDEN``.
* **Between layers.** What runs eagerly between compiled layers (``between_layers``) is
  counted operator by operator; in the backward, the add of the two gradients of a tensor
  a layer reads and hands on (``_passed_through``).
* **The minimum.** Each design declares what its formula must read and write at least once
  per sublayer (``ResidualDesign.minimum_traffic``, with its derivation), and the account
  is shown beside it.
* **As on a GPU.** Inductor inlines a pointwise result into its consumers unless it is too
  large to repeat, by limits that differ on the CPU (ops per expression and reads, which
  the layers set themselves: ``INLINE_LIMITS``, ``t2train/nn/compiling.py``; and reused
  exp, sigmoid or tanh results, always written out on the CPU), and its C++ backend fuses
  by rules of its own. The account lowers each graph as on a GPU, with the layers' limits,
  and fuses it with Triton's scheduling (``_lowering_as_on_a_gpu``).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

TOKENS = 97  # sequence length x micro-batch; prime, so no weight has a multiple of it
HIDDEN = 64
HEADS = 4
REFERENCE_HIDDEN = 768  # the 125m preset's: where narrow per-token tensors are converted
LAYERS = 4
ACTIVATION_BYTES = 2  # bf16


@dataclass(frozen=True)
class KernelTraffic:
    graph: str  # "forward", "backward" or "between layers"
    kind: str  # Inductor's node kind: fused, extern (a GEMM or custom operator), ...
    name: str
    read: float  # units
    written: float
    narrow_bytes: float  # per token, of tensors narrower than the hidden size

    @property
    def units(self) -> float:
        return self.read + self.written + self.narrow_bytes / (ACTIVATION_BYTES * REFERENCE_HIDDEN)


@dataclass
class LayerAccount:
    """The kernels of one compiled layer, forward and backward, and the eager ops after it."""

    variant: str
    layer: int
    sublayers: int
    kernels: list[KernelTraffic] = field(default_factory=list)

    def units(self, graph: str) -> float:
        """Units per sublayer call in ``graph`` ("between layers" counts with the forward)."""
        graphs = ("forward", "between layers") if graph == "forward" else (graph,)
        return sum(k.units for k in self.kernels if k.graph in graphs) / self.sublayers


@dataclass
class VariantAccount:
    variant: str
    layers: list[LayerAccount]
    minimum: tuple[float, float]  # forward, backward units per sublayer (averaged over layers)

    def units(self, graph: str) -> float:
        return sum(layer.units(graph) for layer in self.layers) / len(self.layers)

    @property
    def total(self) -> float:
        return self.units("forward") + self.units("backward")

    @property
    def ratio(self) -> float:
        return self.total / sum(self.minimum)


def _split_units(accesses: dict) -> tuple[float, float]:
    """(units, narrow bytes per token) of Inductor's per-buffer byte counts: buffers with a
    token axis only; h-wide ones in units, narrower ones in bytes per token."""
    units = narrow = 0.0
    for nbytes in accesses.values():
        nbytes = int(nbytes)
        if nbytes == 0 or nbytes % TOKENS:
            continue  # a weight, or a constant
        per_token = nbytes // TOKENS
        if per_token % (ACTIVATION_BYTES * HIDDEN) == 0:  # a bf16 row at least (an fp32
            # [n, n] per token is HIDDEN bytes at n = 4)
            units += per_token / (ACTIVATION_BYTES * HIDDEN)
        else:
            narrow += per_token
    return units, narrow


def _written_bytes(node) -> dict:
    """What ``node`` writes, per buffer. An operator with several outputs (a custom operator's
    backward: the state's gradient beside narrow ones and the weights') writes them as one
    packed buffer, whose total would be split as one tensor (and dropped when the total is no
    multiple of the tokens): each output is counted by its own size instead."""
    outputs = getattr(getattr(node, "node", None), "outputs", None)
    if not outputs:
        return node.get_read_write_buffer_accesses(False, True)
    return {
        output.get_name(): int(math.prod(output.get_size())) * output.get_dtype().itemsize
        for output in outputs
        if hasattr(output, "get_size")
    }


def _read_bytes(node) -> dict:
    """What ``node`` reads, per buffer. Inductor's estimate caps a buffer's bytes by the
    elements a single node's loop reaches, but takes the whole buffer for a fused node: a
    kernel of several nodes reading one row of a stacked tensor (Block AttnRes' phase-1
    mixtures, [S, tokens, h]) would count all S rows. A fused node's reads are here its
    nodes' distinct accesses (one index into one buffer counted once, however many of its
    nodes use it), each the elements its index ranges over, at most the buffer's size."""
    from torch._inductor.dependencies import MemoryDep
    from torch._inductor.scheduler import ExternKernelSchedulerNode, FusedSchedulerNode
    from torch._inductor.virtualized import V

    if isinstance(node, ExternKernelSchedulerNode):
        return _extern_read_bytes(node)
    reads = node.read_writes.reads
    if not isinstance(node, FusedSchedulerNode) or not all(
        isinstance(dep, MemoryDep) for dep in reads
    ):
        return node.get_read_write_buffer_accesses(True, False)
    accesses: dict[str, dict] = {}
    for dep in reads:
        canonical = dep.normalize()
        accesses.setdefault(dep.name, {})[(canonical.index, tuple(canonical.size))] = dep
    sizes = V.graph.sizevars
    counted = {}
    for name, deps in accesses.items():
        buffer = V.graph.name_to_buffer.get(name) or V.graph.graph_inputs.get(name)
        if buffer is None:
            continue
        elements = sum(
            sizes.optimization_hint(dep.get_numel(), fallback=0) for dep in deps.values()
        )
        whole = sizes.optimization_hint(math.prod(buffer.get_size()), fallback=0)
        counted[name] = min(elements, whole) * buffer.get_dtype().itemsize
    return counted


def _extern_read_bytes(node) -> dict:
    """What an extern call (a GEMM, a custom operator) reads, per buffer: each input as the
    call sees it, a view of a buffer by the view's size (Inductor counts the whole buffer
    under any view: phase 2 handed one row of phase 1's [S, tokens, h] mixtures). Each input
    once: every kernel operator launches one kernel (``tests/kernels/test_kernel_ops.py``)."""
    from torch._inductor.ir import MultiOutputLayout
    from torch._inductor.virtualized import V

    sizes = V.graph.sizevars
    inductors = node.get_read_write_buffer_accesses(True, False)
    counted: dict[str, int] = {}
    for tensor in _flat_inputs(node.node.inputs):
        name = tensor.get_name()
        buffer = V.graph.name_to_buffer.get(name) or V.graph.graph_inputs.get(name)
        if buffer is None or isinstance(getattr(buffer, "layout", None), MultiOutputLayout):
            if name in inductors:  # a packed output of another call: Inductor's count
                counted[name] = inductors[name]
            continue
        seen = sizes.optimization_hint(math.prod(tensor.get_size()), fallback=0)
        whole = sizes.optimization_hint(math.prod(buffer.get_size()), fallback=0)
        elements = min(whole, counted.get(name, 0) // buffer.get_dtype().itemsize + seen)
        counted[name] = elements * buffer.get_dtype().itemsize
    return counted


def _flat_inputs(inputs) -> list:
    """The tensor inputs (IR nodes with a name and a size) of an extern call, lists opened."""
    flat = []
    for item in inputs:
        if isinstance(item, (list, tuple)):
            flat.extend(_flat_inputs(item))
        elif hasattr(item, "get_name") and hasattr(item, "get_size"):
            flat.append(item)
    return flat


def _node_traffic(graph: str, node) -> KernelTraffic:
    read, narrow_read = _split_units(_read_bytes(node))
    written, narrow_written = _split_units(_written_bytes(node))
    kind = type(node).__name__.removesuffix("SchedulerNode") or "Scheduler"
    return KernelTraffic(graph, kind, node.get_name(), read, written, narrow_read + narrow_written)


class _Scheduled(Exception):
    """Raised once Inductor has fused a graph: the account needs no code."""


@contextmanager
def _scheduling_only(recorded: list[KernelTraffic]) -> Iterator[None]:
    """Inductor's codegen replaced by: fuse the graph's nodes, record what each kernel reads
    and writes, stop."""
    from torch._inductor.graph import GraphLowering

    real = GraphLowering.codegen

    def schedule(self):
        self.init_wrapper_code()
        self._update_scheduler()
        graph = "backward" if self.is_backward else "forward"
        recorded.extend(_node_traffic(graph, node) for node in self.scheduler.nodes)
        raise _Scheduled

    # Inductor logs that it kept its scratch folder "on error": the stop is ours
    quiet = logging.getLogger("torch._inductor.utils")
    level = quiet.level
    setattr(GraphLowering, "codegen", schedule)
    quiet.setLevel(logging.ERROR)
    try:
        yield
    finally:
        setattr(GraphLowering, "codegen", real)
        quiet.setLevel(level)


@contextmanager
def _lowering_as_on_a_gpu() -> Iterator[None]:
    """Inductor lowers and fuses a CPU graph by the CPU's rules; these answers give the GPU's.

    * Which results are written out: the IR asks ``is_cpu`` for its three limits on
      inlining a result (ops per expression, reads, reused costly results), each looser on
      the CPU.
    * Which nodes share a kernel: the C++ backend fuses by its own rules (a loop over the
      tokens around reductions of different sizes, which a GPU kernel never is); Triton's
      scheduling (``cpu_backend="triton"``) fuses as on a GPU, and its nodes answering that
      they are on a GPU also get the fusions Inductor enables there alone (reductions of
      two orders, nested reductions, reordered loops).
    * Whether a row and a column reduction of the same tensors share a kernel (a norm's
      input gradient and its weight's, "mix-order" reductions): Inductor fuses them from
      a size on (5 Mi elements, 4096 rows, twice as many rows as columns), which each
      preset the GPU check runs reaches and the account's few tokens do not; the account
      skips that size check (``tests/bench/test_byte_account.py`` holds the presets to it).

    (A torch that renames any of these fails here, loudly.)"""
    from unittest import mock

    from torch._inductor import config, ir, scheduler

    node = scheduler.BaseSchedulerNode
    with (
        mock.patch.object(ir, "is_cpu", lambda _node: False),
        config.patch({"cpu_backend": "triton", "triton.mix_order_reduction_non_strict_mode": True}),
        mock.patch.object(node, "is_cpu", lambda _self: False),
        mock.patch.object(node, "is_gpu", lambda _self: True),
        mock.patch.object(scheduler, "_is_gpu_triton_backend", lambda _a, _b: True),
    ):
        yield


def _accounting_backend(recorded: list[KernelTraffic]):
    """A ``torch.compile`` backend: Inductor's whole pipeline (decompositions, the min-cut
    partition of forward and backward, post-grad passes, lowering, fusion) up to the kernels'
    code, recorded; each graph then runs eagerly as Inductor received it."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        eager = copy.deepcopy(gm)  # the post-grad passes rewrite gm in place
        with _scheduling_only(recorded), _lowering_as_on_a_gpu():
            try:
                compile_fx_inner(gm, example_inputs, **kwargs)
            except Exception as err:  # Inductor wraps what the codegen raised
                if not isinstance(getattr(err, "inner_exception", err), _Scheduled):
                    raise

        def run(args):
            out = eager(*args)
            args.clear()
            return out

        setattr(run, "_boxed_call", True)  # AOTAutograd passes the arguments as one list
        return run

    return lambda gm, example_inputs: compile_fx(gm, example_inputs, inner_compile=inner)


def _overwriting_operators() -> frozenset:
    import torch

    aten = torch.ops.aten
    return frozenset((aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default))


class _EagerTraffic:
    """A dispatch mode counting what each operator run eagerly reads and writes."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        kernels = self.kernels = []
        overwriting = _overwriting_operators()

        class Counting(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch
                from torch.utils._pytree import tree_leaves

                out = func(*args, **(kwargs or {}))
                if func.is_view:  # an alias: nothing moves
                    return out

                def sizes(values) -> dict:
                    tensors = [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]
                    return {id(t): t.numel() * t.element_size() for t in tensors}

                # a copy or fill writes its destination without reading it
                inputs = args[1:] if func in overwriting else args
                read, narrow_read = _split_units(sizes((inputs, kwargs)))
                written, narrow_written = _split_units(sizes(out))
                if read or written or narrow_read or narrow_written:
                    kernels.append(
                        KernelTraffic(
                            "between layers",
                            "eager",
                            str(func),
                            read,
                            written,
                            narrow_read + narrow_written,
                        )
                    )
                return out

        self.mode = Counting()


def _overrides(variant: str, extra: tuple[str, ...]) -> list[str]:
    from t2train.config.loader import load_config
    from t2train.residual import variant_overrides

    shape = [
        "data.path=unused",
        f"model.seq_length={TOKENS}",
        "train.micro_batch_size=1",
        "train.global_batch_size=1",
        f"model.hidden_size={HIDDEN}",
        f"model.num_attention_heads={HEADS}",
        f"model.num_layers={LAYERS}",
        "train.precision=bf16",
        "model.fusions=all",
    ]
    # the mixer's window does not matter: its body is a GEMM here
    selected = variant_overrides(variant, load_config(overrides=shape).model)
    return [*shape, *selected, *extra]


def _gemm_body(hidden: int):
    import torch

    class GemmBody(torch.nn.Module):
        """A sublayer body's boundary: one GEMM from the normed input to the output."""

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(
                torch.randn(hidden, hidden, dtype=torch.bfloat16) / hidden**0.5
            )

        def forward(self, normed, **_):
            return normed @ self.weight, None

    return GemmBody()


@contextmanager
def _kernels_traced_not_launched(kernels: bool) -> Iterator[None]:
    """The Triton kernels as the GPU runs them (custom operators, ``T2_KERNELS=triton``),
    each allocating its outputs and launching nothing: the account reads the operators'
    inputs and outputs, not their values (the interpreter would take minutes). Without
    ``kernels``, their PyTorch references, compiled with the rest."""
    from t2train.kernels import ops
    from t2train.kernels.dispatch import load_kernels
    from t2train.residual import kernel_table

    saved = {name: os.environ.get(name) for name in ("T2_KERNELS", "TRITON_INTERPRET")}
    os.environ["T2_KERNELS"] = "triton" if kernels else "torch"
    os.environ["TRITON_INTERPRET"] = "1"  # the route's check on CPU tensors; nothing runs
    load_kernels(kernel_table().values())  # registers the operators: first, to patch them
    patched = [
        function.__globals__
        for function in ops.IMPLEMENTATIONS.values()
        if function.__globals__.get("tracing") is ops.tracing
    ]
    for namespace in patched:
        namespace["tracing"] = lambda _tensor: True
    try:
        yield
    finally:
        for namespace in patched:
            namespace["tracing"] = ops.tracing
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def _layers(config):
    """The decoder's layers, each sublayer body a GEMM, its stream, and the RoPE table."""
    import torch

    from t2train.model.build import build_model_chunks, transformer_config

    tf_config = transformer_config(config)
    tf_config.params_dtype = torch.bfloat16
    torch.manual_seed(0)
    [model] = build_model_chunks(config, tf_config, vocab_size=16)
    model.to(torch.bfloat16)
    layers, stream = model.layers_and_stream()
    for layer in layers:
        layer.self_attention, layer.mlp = _gemm_body(HIDDEN), _gemm_body(HIDDEN)
        if layer.pre_attention is not None:
            layer.pre_attention = _gemm_body(HIDDEN)
    return layers, stream, model.rotary_pos_emb(TOKENS)


def _leaves_requiring_grad(state):
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(state)
    fresh = [
        leaf.detach().clone().requires_grad_() if getattr(leaf, "is_floating_point", None) else leaf
        for leaf in leaves
    ]
    return tree_unflatten(fresh, spec)


def account_layers(
    variant: str, extra: tuple[str, ...] = (), kernels: bool = True
) -> list[LayerAccount]:
    """The account of each layer of a ``LAYERS``-layer decoder of ``variant`` (``<design>``
    or ``<design>+<mixer>``; ``extra``: more config overrides), each layer compiled alone;
    with the Triton kernels, or (``kernels=False``) their references compiled."""
    import torch
    from torch.utils._pytree import tree_leaves

    from t2train.config.loader import load_config
    from t2train.nn.compiling import inductor_options, trace_megatron_modules
    from t2train.parallel.init import one_process_world
    from t2train.residual import get_design, sublayer_names

    config = load_config(overrides=_overrides(variant, extra))
    options = inductor_options(get_design(config.model.residual).inductor_options)
    one_process_world()
    trace_megatron_modules()
    accounts = []
    with (
        _kernels_traced_not_launched(kernels),
        # every graph fused anew, with the options the layers compile with
        torch._inductor.config.patch({"force_disable_caches": True, **options}),
        warnings.catch_warnings(),
    ):
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
        layers, stream, rope = _layers(config)
        hidden = torch.randn(TOKENS, 1, HIDDEN, dtype=torch.bfloat16)
        with torch.no_grad():
            state = stream.enter(hidden)
        for index, layer in enumerate(layers):
            recorded: list[KernelTraffic] = []
            torch._dynamo.reset()
            # fullgraph: a break would run part of the layer eagerly, uncounted
            compiled = torch.compile(layer, backend=_accounting_backend(recorded), fullgraph=True)
            inputs = _leaves_requiring_grad(state)
            out = compiled(inputs, None, rope)
            grads = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            tangents = [torch.randn_like(t) for t in grads]
            torch.autograd.backward(grads, tangents)
            recorded.extend(_passed_through(inputs, grads, tangents))
            eager, out = _EagerTraffic(), _detached(out)
            with torch.no_grad(), eager.mode:
                state = stream.between_layers(out)
            accounts.append(
                LayerAccount(
                    variant,
                    index,
                    len(sublayer_names(config.model)),
                    recorded + eager.kernels,
                )
            )
        torch._dynamo.reset()
    return accounts


def _passed_through(inputs, outputs: list, tangents: list) -> list[KernelTraffic]:
    """A tensor the layer hands on as it came and also reads (AttnRes' earlier sources) gets
    one gradient from the layer's backward and one from what comes after it: autograd adds
    the two eagerly, between the layers' backward graphs, reading both and writing the sum.
    Such an input's gradient is its output's plus the layer's own (an input only handed on,
    as the sources' buffer, gets the output's alone and nothing is added). A tensor handed
    on through the compiled graph (an output of it, aliasing the input) brings its gradient
    into the layer's backward, whose kernels add it."""
    import torch
    from torch.utils._pytree import tree_leaves

    def key(t):
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))

    given = {key(t): t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    added = []
    for output, tangent in zip(outputs, tangents):
        source = given.get(key(output))
        if source is None or source.grad is None or torch.equal(source.grad, tangent):
            continue
        if type(output.grad_fn).__name__ == "CompiledFunctionBackward":
            continue
        units, narrow = _split_units({"gradient": output.numel() * output.element_size()})
        name = "aten.add (its gradients from the layer and after it)"
        added.append(KernelTraffic("backward", "eager", name, 2 * units, units, 3 * narrow))
    return added


def _detached(state):
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach() if hasattr(t, "detach") else t, state)


def account_variant(
    variant: str, extra: tuple[str, ...] = (), kernels: bool = True
) -> VariantAccount:
    """Every layer's account of ``variant`` and its design's declared minimum, averaged."""
    from t2train.config.loader import load_config
    from t2train.residual import get_design

    design = get_design(variant.partition("+")[0])
    if design.minimum_traffic is None:
        raise ValueError(f"design {design.name!r} declares no minimum_traffic")
    model = load_config(overrides=_overrides(variant, extra)).model
    layers = account_layers(variant, extra, kernels)
    minima = [design.minimum_traffic(model, layer.layer) for layer in layers]
    minimum = (
        sum(m.forward for m in minima) / len(minima),
        sum(m.backward for m in minima) / len(minima),
    )
    return VariantAccount(variant, layers, minimum)


TABLE_HEADER = (
    "| variant | forward | backward | total | minimum (fwd + bwd) | now / minimum | "
    "kernels per layer, fwd / bwd (of them barriers) |\n|---|---|---|---|---|---|---|"
)


def _kernel_counts(account: VariantAccount, graph: str) -> str:
    kernels = [
        k
        for layer in account.layers
        for k in layer.kernels
        if k.units and (k.graph == graph or (graph == "forward" and k.graph == "between layers"))
    ]
    barriers = [k for k in kernels if k.kind in ("ExternKernel", "eager")]
    per_layer = len(account.layers)
    return f"{len(kernels) / per_layer:.1f} ({len(barriers) / per_layer:.1f})"


def table_row(account: VariantAccount) -> str:
    fwd, bwd = account.minimum
    return (
        f"| {account.variant} | {account.units('forward'):.1f} | "
        f"{account.units('backward'):.1f} | {account.total:.1f} | "
        f"{fwd:.1f} + {bwd:.1f} = {fwd + bwd:.1f} | {account.ratio:.2f}x | "
        f"{_kernel_counts(account, 'forward')} / {_kernel_counts(account, 'backward')} |"
    )


def format_kernels(account: VariantAccount) -> str:
    """Every kernel of every layer, per sublayer call."""
    lines = [f"{account.variant}: units per sublayer call (reads + writes), by layer"]
    for layer in account.layers:
        lines.append(
            f"  layer {layer.layer}: forward {layer.units('forward'):.2f}, "
            f"backward {layer.units('backward'):.2f}"
        )
        per = layer.sublayers
        for k in layer.kernels:
            if k.units:
                lines.append(
                    f"    {k.graph:<14} {k.kind:<18} {k.name:<22} read {k.read / per:5.2f}  "
                    f"written {k.written / per:5.2f}  narrow {k.narrow_bytes / per:5.0f} B/token"
                )
    return "\n".join(lines)


def register(tools) -> None:
    bytes_ = tools.add_parser(
        "bytes",
        help="bytes each residual design moves per sublayer, counted from its compiled layer",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
    )
    bytes_.add_argument(
        "--variants",
        help="comma-separated <design> or <design>+<mixer> (default: every design, alone "
        "and with the mixer)",
    )
    bytes_.add_argument(
        "--kernels", action="store_true", help="also list every kernel of every layer"
    )
    bytes_.add_argument(
        "--references",
        action="store_true",
        help="the designs' PyTorch references compiled in place of their Triton kernels "
        "(which custom operators the compiler's fusion beats)",
    )
    bytes_.set_defaults(handler=_cmd_bytes)


def _cmd_bytes(args) -> int:
    from t2train.bench.variants import all_variants

    variants = args.variants.split(",") if args.variants else all_variants()
    print(
        f"Units per sublayer call: [tokens, hidden] bf16 tensors read + written by the "
        f"kernels of one compiled layer (each sublayer body a GEMM), averaged over the "
        f"{LAYERS} layers of a {LAYERS}-layer decoder; narrow per-token tensors at hidden "
        f"{REFERENCE_HIDDEN}.\n"
    )
    print(TABLE_HEADER)
    accounts = []
    for variant in variants:
        accounts.append(account_variant(variant, kernels=not args.references))
        print(table_row(accounts[-1]), flush=True)
    if args.kernels:
        for account in accounts:
            print("\n" + format_kernels(account))
    return 0
