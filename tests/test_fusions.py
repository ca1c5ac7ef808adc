"""The fused hot path (``model.fusions``): same training as the eager path, whole graphs, and
its loss checked against the formula.

Compiling on this CPU is slow (a cold Inductor compile of one layer takes 15-60 s on the
shared 2-core machine), so the training comparisons compile with ``aot_eager``: dynamo's
graphs and AOTAutograd's forward/backward split, i.e. everything of the fused path but
Inductor's code generation; ``test_op_budget.py`` compiles one layer with Inductor.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple, Optional

import pytest
import torch
from compile_breaks import graph_breaks

from t2train.config.loader import load_config
from t2train.nn.compiling import BACKEND_VARIABLE, replace_fields
from t2train.residual import registered

from variants import depth_dependent

TINY = [
    "data.path=unused",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.num_query_groups=1",
    "model.seq_length=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.warmup_steps=0",
    "train.steps=2",
    "train.lr=1e-2",
]
VOCAB = 128


@pytest.fixture(autouse=True)
def cheap_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager")


def _steps(count: int = 2) -> list:
    g = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(count):
        tokens = [torch.randint(0, VOCAB, (2, 17), generator=g) for _ in range(2)]
        steps.append([{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tokens])
    return steps


def _train(overrides: list[str], topology) -> list[float]:
    from t2train.engine.megatron.setup import build_training_objects
    from t2train.engine.megatron.step import train_step
    from t2train.parallel.init import set_seed

    set_seed(1234, topology)
    objs = build_training_objects(load_config(overrides=TINY + overrides), VOCAB)
    return [train_step(objs, micro_batches).loss for micro_batches in _steps()]


# (overrides, distinct layer graphs): a layer compiles once for all layers of a chunk unless
# its inputs differ: hc's first layer gets the embedding broadcast to n streams (a stride-0
# view); attnres' layers read more sources each, one graph for any count.
VARIANTS = {
    "standard": ([], 1),
    "hc": (["model.residual=hc"], 2),
    "standard+shortswa": (["model.shortswa.window=4"], 1),
    "attnres": (["model.residual=attnres"], 1),
    # the write fused into the add (residual/ddl/compiled.py), its backward by hand
    "ddl": (["model.residual=ddl"], 1),
    "ddl-dv4": (["model.residual=ddl", "model.ddl.dv=4"], 1),
    # the layer one checkpointed region of its graph, hc's read handing its write values
    # through module attributes inside it
    "hc+selective": (["model.residual=hc", "model.recompute=selective"], 2),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_training_matches_eager(megatron_world, variant):
    """Two optimizer steps (two micro-batches each, lr 1e-2 so the second step's loss
    depends on the first update) give the eager losses within 1e-5 relative, and every layer
    ran compiled (not silently eager) and without a graph break."""
    from torch._dynamo.utils import counters

    overrides, layer_graphs = VARIANTS[variant]
    eager = _train(overrides + ["model.fusions=none"], megatron_world)
    counters.clear()
    torch._dynamo.reset()
    fused = _train(overrides + ["model.fusions=all"], megatron_world)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=0)
    assert eager[1] != eager[0]
    assert graph_breaks(counters) == {}
    assert counters["stats"]["unique_graphs"] == layer_graphs + 2  # + the loss's two kernels


def _reference_loss(logits, target):
    """Cross-entropy written out: logsumexp over the vocabulary minus the target's logit."""
    z = logits.double()
    return torch.logsumexp(z, -1) - z.gather(-1, target.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cross_entropy_is_the_formula(dtype):
    from t2train.nn.cross_entropy import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(5, 3, 40, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(0, 40, (5, 3), generator=g)
    weights = torch.rand(5, 3, generator=g)  # a non-uniform upstream gradient
    loss = vocab_parallel_cross_entropy(logits, target)
    assert loss.dtype == torch.float32
    (loss * weights).sum().backward()
    expected = _reference_loss(logits.detach(), target)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)
    z = logits.detach().double()
    one_hot = torch.nn.functional.one_hot(target, 40).double()
    grad = (torch.softmax(z, -1) - one_hot) * weights.double().unsqueeze(-1)
    assert logits.grad.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # one bf16 rounding of the gradient
    torch.testing.assert_close(logits.grad.double(), grad, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    "fusions,cuda,expected",
    [("auto", True, True), ("auto", False, False), ("all", False, True), ("none", True, False)],
)
def test_fusions_default_to_all_with_cuda_only(monkeypatch, fusions, cuda, expected):
    from t2train.model import build

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    config = load_config(overrides=TINY + [f"model.fusions={fusions}"])
    assert build.fusions_on(config) is expected
    tf_config = build.transformer_config(config)
    assert tf_config.t2_fused_loss is expected and tf_config.bias_activation_fusion is expected


# Each design with the local mixer (its kernels, and the mixer's window attention called from
# inside Megatron's attention: the call that used to split a layer into most pieces), and
# `standard` alone. A design alone makes a subset of the same calls.
COMPILED_VARIANTS = ["standard"] + [f"{design}+shortswa" for design in registered()]
# The designs whose state changes structure with depth (tests/variants.py): the only ones
# whose graphs could multiply with depth, alone and with the mixer.
DEPTH_VARIANTS = [
    variant
    for design in registered()
    if depth_dependent(design)
    for variant in (design, f"{design}+shortswa")
]
# Every design compiles the same graphs at any depth: one, or two for hc and mhc (the first
# layer's stream is the embedding broadcast to n streams, a stride-0 view); depth_attn one
# per length of its window until the window is full (K); block_attnres one per place a
# layer can take in a block (its reads open, continue or close blocks differently). AttnRes'
# growing sources are one tensor with a dynamic number of rows.
DEPTH_WINDOW = 4
BLOCK_SIZE = 3
SEQ = 4  # tokens per sample: short, as the kernels run under the interpreter
KERNEL_SHAPE = [
    "data.path=unused",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.num_query_groups=1",
    "model.seq_length=8",
    f"model.attnres.block_size={BLOCK_SIZE}",
    f"model.depth_attn.window={DEPTH_WINDOW}",
    "model.mhc.sinkhorn_iterations=3",
]


def layer_graphs(variant: str, layers: int) -> int:
    """Distinct graphs a ``layers``-layer decoder of ``variant`` compiles."""
    design, _, mixer = variant.partition("+")
    if design == "depth_attn":
        return min(layers, DEPTH_WINDOW)
    if design == "block_attnres":
        per_layer = 3 if mixer else 2
        return BLOCK_SIZE // math.gcd(per_layer, BLOCK_SIZE)
    return 2 if design in ("hc", "mhc") else 1


def _decoder_with_kernels(variant: str, layers: int):
    from t2train.model.build import build_model_chunks, transformer_config

    design, _, mixer = variant.partition("+")
    config = load_config(
        overrides=KERNEL_SHAPE
        + [
            f"model.num_layers={layers}",
            f"model.residual={design}",
            f"model.shortswa.window={4 if mixer else 0}",
            "model.fusions=none",
        ]
    )
    torch.manual_seed(0)
    [model] = build_model_chunks(config, transformer_config(config), VOCAB)
    with torch.no_grad():  # zero-initialised parts (pseudo-queries, out projections) count too
        for param in model.decoder.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.decoder, model.rotary_pos_emb(SEQ)


def _compile_with_kernels(decoder, monkeypatch):
    """``decoder``'s layers compiled as the fused path compiles them, the kernels forced."""
    from torch._dynamo.utils import counters

    from t2train.kernels.dispatch import load_kernels
    from t2train.nn.compiling import compile_modules
    from t2train.residual import kernel_table

    monkeypatch.setenv("T2_KERNELS", "triton")
    torch._dynamo.reset()
    counters.clear()
    load_kernels(kernel_table().values())
    compile_modules(decoder.layers)
    return counters


def _forward_backward(decoder, rotary, hidden):
    hidden = hidden.detach().requires_grad_()
    decoder.zero_grad(set_to_none=True)
    out = decoder(hidden, None, rotary_pos_emb=rotary)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), [hidden.grad] + [p.grad for p in decoder.parameters()]


@pytest.mark.parametrize("variant", COMPILED_VARIANTS)
def test_with_the_kernels_every_layer_is_one_graph(megatron_world, monkeypatch, variant):
    """The Triton kernels (under the interpreter) are operators inside the compiled layer:
    no graph break anywhere, also inside Megatron's attention (the mixer's window
    attention), the graphs ``layer_graphs`` says, and the output and every gradient those of
    the same layers run eagerly with the kernels (tests/kernels/test_kernel_training.py
    compares the kernels with the references)."""
    decoder, rotary = _decoder_with_kernels(variant, layers=3)
    hidden = torch.randn(SEQ, 2, 32, generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv("T2_KERNELS", "triton")
    eager, eager_grads = _forward_backward(decoder, rotary, hidden)
    counters = _compile_with_kernels(decoder, monkeypatch)
    compiled, compiled_grads = _forward_backward(decoder, rotary, hidden)
    assert graph_breaks(counters) == {}
    assert counters["stats"]["unique_graphs"] == layer_graphs(variant, 3)
    for ours, theirs in zip([compiled] + compiled_grads, [eager] + eager_grads):
        # fp32 rounding: the compiled graph may order a sum of gradients differently (AttnRes'
        # pseudo-queries: 1.4e-6 of the largest entry; HC's one-number scales, sums over every
        # token whose projections are summed products compiled and a GEMM eagerly: 3.8e-5)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=5e-5 * theirs.abs().max())


@pytest.mark.parametrize("variant", DEPTH_VARIANTS)
def test_the_graphs_do_not_multiply_with_depth(megatron_world, monkeypatch, variant):
    """Every design whose state grows with depth, alone and with the mixer, compiles the
    graphs ``layer_graphs`` says at 3 layers and at 9 (past the depth window and three block
    cycles), without a graph break (forward: the
    count of graphs is dynamo's, and each has one backward; one sample). The variants of the
    test above are checked at 3 layers there. A design whose state keeps its structure
    gives every layer the same inputs: its graphs are those of 3 layers."""
    for layers in (9,) if variant in COMPILED_VARIANTS else (3, 9):
        decoder, rotary = _decoder_with_kernels(variant, layers=layers)
        counters = _compile_with_kernels(decoder, monkeypatch)
        with torch.no_grad():
            decoder(torch.randn(SEQ, 1, 32), None, rotary_pos_emb=rotary)
        assert (layers, graph_breaks(counters)) == (layers, {})
        assert (layers, counters["stats"]["unique_graphs"]) == (
            layers,
            layer_graphs(variant, layers),
        )


def test_a_break_on_a_data_dependent_guard_is_counted():
    """``torch.logsumexp`` over a dimension of unbacked size, under autocast switched off (as
    AttnRes' reference ran it), asks whether the tensor is empty: dynamo splits the graph
    there and counts the resume, not a graph break."""
    from torch._dynamo.decorators import mark_unbacked
    from torch._dynamo.utils import counters

    def logsumexp_of_scores(rows, query):
        with torch.autocast("cpu", enabled=False):
            return torch.logsumexp(rows @ query, dim=0)

    torch._dynamo.reset()
    counters.clear()
    rows = torch.randn(5, 3, 8, requires_grad=True)[:4]
    mark_unbacked(rows, 0)
    torch.compile(logsumexp_of_scores, backend="aot_eager")(rows, torch.randn(8, 2))
    assert dict(counters["graph_break"]) == {}
    assert graph_breaks(counters) != {}


def test_diagnostics_reach_a_compiled_layer(megatron_world):
    """The diagnostics pass hooks the layers' norms after they were compiled, and the model
    records values through ``probe.record``: both must run, not be compiled away."""
    from t2train.model.build import build_model_chunks, transformer_config
    from t2train.nn import probe

    config = load_config(overrides=TINY + ["model.shortswa.window=4", "model.fusions=all"])
    [model] = build_model_chunks(config, transformer_config(config), VOCAB)
    layer, hidden, rotary = (
        model.decoder.layers[0],
        torch.randn(16, 2, 32),
        model.rotary_pos_emb(16),
    )
    layer.eval()
    with torch.no_grad():  # an evaluation, compiled without hooks
        layer(hidden, None, rotary)
    seen = []
    hook = layer.input_layernorm.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    with torch.no_grad():
        layer(hidden, None, rotary)
        with probe.recording() as records:
            layer(hidden, None, rotary)
        hook.remove()
        layer(hidden, None, rotary)
    assert len(seen) == 2 and list(records) == ["shortswa_entropy"]


class _Fields(NamedTuple):
    first: torch.Tensor
    more: tuple = ()
    last: Optional[torch.Tensor] = None


def test_replace_fields_survives_compilation():
    """A compiled function that returns ``replace_fields``' result returns every field (torch
    2.11's dynamo returns ``_replace``'s as an empty tuple); an unknown field is refused."""
    x = torch.ones(2)

    def grow(fields: _Fields) -> _Fields:
        return replace_fields(fields, more=fields.more + (fields.first * 2,), last=fields.first)

    out = torch.compile(grow, backend="eager", fullgraph=True)(_Fields(x))
    assert len(out) == 3
    torch.testing.assert_close(out.more[0], 2 * x)
    assert out.last is not None
    with pytest.raises(ValueError, match=r"_Fields has no field\(s\) \['middle'\]"):
        replace_fields(_Fields(x), middle=x)


def test_no_module_calls_namedtuple_replace():
    """The package's code may run compiled, where ``_replace`` breaks with torch 2.11 (the
    GPU image's): ``replace_fields`` is the spelling that works with every version."""
    root = Path(__file__).parents[1]
    callers = [
        str(path.relative_to(root))
        for folder in ("t2train", "kernels", "data", "launch")
        for path in sorted((root / folder).rglob("*.py"))
        if "._replace(" in path.read_text()
    ]
    assert callers == []


def test_layers_compile_with_inductors_inline_limits_raised(monkeypatch):
    """With Inductor, each layer compiles with ``INLINE_LIMITS`` and its design's own options
    (what ``t2train bench bytes`` lowers with); other backends take no options."""
    from t2train.nn import compiling

    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: calls.append(kwargs))
    layers = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    design = {"max_fusion_size": 256, "realize_acc_reads_threshold": 32}
    compiling.compile_modules(layers, backend="inductor")
    compiling.compile_modules(layers[:1], backend="inductor", design_options=design)
    compiling.compile_modules(layers, backend="aot_eager", design_options=design)
    limits = compiling.INLINE_LIMITS
    assert calls == (
        2 * [{"backend": "inductor", "options": limits}]
        + [{"backend": "inductor", "options": {**limits, **design}}]
        + 2 * [{"backend": "aot_eager", "options": None}]
    )
    assert calls[2]["options"]["realize_acc_reads_threshold"] == 32  # the design's wins


def test_a_built_model_compiles_its_layers_with_its_designs_options(megatron_world, monkeypatch):
    """``build_model_chunks`` hands the design's ``inductor_options`` to ``compile_modules``
    with every layer of the chunk."""
    from t2train.model.build import build_model_chunks, transformer_config
    from t2train.nn import compiling
    from t2train.residual import get_design

    given = []
    monkeypatch.setattr(
        compiling, "compile_modules", lambda layers, **kwargs: given.append((layers, kwargs))
    )
    config = load_config(
        overrides=KERNEL_SHAPE + ["model.num_layers=2", "model.residual=hc", "model.fusions=all"]
    )
    [model] = build_model_chunks(config, transformer_config(config), VOCAB)
    [(layers, kwargs)] = given
    assert layers == list(model.decoder.layers)
    assert kwargs == {"design_options": get_design("hc").inductor_options}
