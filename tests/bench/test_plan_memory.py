"""`t2train plan`'s activation memory against what compiled layers save for their backward, for
`standard`'s layer and every design's declared count (``ResidualDesign.saved_per_token``);
and, written out again here from their definitions (t2train/bench/plan.py's docstring), the
local mixer's sublayer across tensor ranks, mHC's streams and mappings, AttnRes' sources,
full and selective recompute and the logits."""

from __future__ import annotations

import pytest

from t2train.bench.plan import layer_bytes_per_token, plan_layout
from t2train.config.loader import load_config
from t2train.residual import BASELINE, registered

S, B, H, L, V = 64, 2, 32, 4, 512  # sequence, micro-batch, hidden, layers, vocabulary
SHAPE = [
    "data.path=unused",
    f"model.seq_length={S}",
    f"train.micro_batch_size={B}",
    f"model.hidden_size={H}",
    f"model.num_layers={L}",
    "model.num_attention_heads=4",
    "train.global_batch_size=4",
    "train.precision=bf16",
]
UNIT = S * B * H * 2  # one [s, b, h] bf16 unit, bytes


def _activations(*overrides: str, vocab: int = V, tp: int = 1) -> int:
    config = load_config(overrides=[*SHAPE, f"parallel.tensor={tp}", *overrides])
    (stage,) = plan_layout(config, vocab, world_size=tp).stages
    return stage.activation_bytes


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_mixer_adds_an_attention_sublayer_per_layer(sequence_parallel):
    """Its input state and normed input (split only by sequence parallelism, as the norm's
    fp32 1/rms), the QKV projection, Q and K after RoPE and the output (split by tensor
    parallelism, as the fp32 log-sum-exp of each head)."""
    heads, kv = 4, H  # no query groups: K and V as wide as Q
    for tp in (2, 4) if sequence_parallel else (1, 2):
        whole = tp if sequence_parallel else 1
        per_token = 2 * (2 * H / whole + (3 * H + 3 * kv) / tp) + 4 * (1 / whole + heads / tp)
        added = _activations(
            "model.shortswa.window=8", f"parallel.sequence_parallel={sequence_parallel}", tp=tp
        ) - _activations(f"parallel.sequence_parallel={sequence_parallel}", tp=tp)
        assert added == pytest.approx(L * S * B * per_token, abs=2), tp


FP32_PER_TOKEN = S * B * 4  # one fp32 number per token, bytes


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("mixer", [False, True])
def test_mhc_keeps_its_n_streams_and_fp32_mappings_per_sublayer(n, mixer):
    """Per sublayer (attention, the MLP and the mixer's when on): the n streams and the
    sublayer output, less the norm's input standard keeps (the compiled read is rebuilt from
    the streams): n units beyond standard's; and fp32 per token: the normed projection that
    makes the mappings (n^2 + 2n) and its inverse RMS, the mappings' logits and the mappings
    (H~post, H~res, H_post, H_res: 2 (n + n^2)), less the pre-norm's inverse RMS (the read
    applies the norm); the embedding enters as n views of one unit (n - 1 units fewer)."""
    on = ["model.shortswa.window=8"] if mixer else []
    sublayers = L * (3 if mixer else 2)
    added = _activations("model.residual=mhc", f"model.mhc.expansion_rate={n}", *on) - (
        _activations(*on)
    )
    fp32 = (n * n + 2 * n) + 1 + 2 * (n + n * n) - 1
    expected = (sublayers * n - (n - 1)) * UNIT + sublayers * fp32 * FP32_PER_TOKEN
    assert added == pytest.approx(expected, abs=2)
    eager = [*on, "model.fusions=none"]  # compiled layers keep the states
    dropped = _activations(
        "model.residual=mhc",
        f"model.mhc.expansion_rate={n}",
        "model.mhc.recompute_streams=true",
        *eager,
    ) - _activations("model.residual=mhc", f"model.mhc.expansion_rate={n}", *eager)
    between = 2 if mixer else 1  # the states between a layer's sublayers, rebuilt in backward
    assert dropped == pytest.approx(-L * between * n * UNIT, abs=2)
    compiled = _activations(
        "model.residual=mhc", f"model.mhc.expansion_rate={n}", "model.mhc.recompute_streams=true"
    ) - _activations("model.residual=mhc", f"model.mhc.expansion_rate={n}")
    assert compiled == 0


def test_full_attention_residuals_keep_each_source_once_and_a_fresh_one_twice():
    """Full AttnRes makes one source per sublayer (and the embedding), kept until backward;
    the attention output the MLP's read takes before it joins the buffer is kept again; each
    read (every sublayer's and the final one) keeps one fp32 number per token."""
    added = _activations("model.residual=attnres") - _activations()
    reads = 2 * L + 1
    assert added == pytest.approx((reads + L) * UNIT + reads * FP32_PER_TOKEN, abs=2 * L)


def test_the_last_stage_holds_the_logits_and_their_gradient():
    assert _activations(vocab=2 * V) - _activations() == 2 * S * B * V * 2


def _packed_inputs(design: str, layers: int = L) -> int:
    """Units of the layers' inputs under full recompute: each layer's stream state, packed."""
    if design == "hc":
        return layers * 4  # n = 4 streams entering every layer
    if design == "attnres":
        return sum(1 + 2 * layer for layer in range(layers))  # the embedding, 2 per layer
    return layers  # one state per layer


@pytest.mark.parametrize("design", ["standard", "hc", "attnres"])
def test_full_recompute_keeps_the_layer_inputs_and_rebuilds_one_layer(design):
    """Korthikanti et al.'s full recompute: each layer's input for every micro-batch in flight
    (one here), and one layer's activations rebuilt at a time in the backward; the last stage
    keeps the final state for its final read (the state after the last layer: the input of
    a layer L + 1)."""
    on = [f"model.residual={design}", "model.recompute=full"]
    model = load_config(overrides=[*SHAPE, *on]).model
    one_layer = S * B * layer_bytes_per_token(model, 1, False, 2)
    logits = 2 * S * B * V * 2
    final = _packed_inputs(design, L + 1) - _packed_inputs(design)
    expected = (_packed_inputs(design) + final) * UNIT + one_layer + logits
    assert _activations(*on) == pytest.approx(expected, abs=8)


def _launching_nothing(monkeypatch) -> None:
    """Every Triton kernel allocates its outputs as while tracing and launches nothing: what
    the compiled layers save is unchanged (the operators' autograd and the partitioner decide
    it), and the kernels' values, not looked at here, would cost minutes under the interpreter.
    Patched where each registered operator's function looks ``tracing`` up: its globals."""
    from t2train.kernels import ops

    for function in ops.IMPLEMENTATIONS.values():
        if function.__globals__.get("tracing") is ops.tracing:
            monkeypatch.setitem(function.__globals__, "tracing", lambda _tensor: True)


def _saved_by_compiled_layers(config) -> int:
    """Bytes of the distinct storages autograd keeps during the layers' forward of a bf16
    decoder whose layers are compiled as on a GPU: Inductor's min-cut partition of what to
    save, with its decompositions (generating no kernels), and the Triton kernels' operators.
    Left aside: the parameters, the shared RoPE table and tensors with no axis as long as the
    sequence (casts of weights, the same size at any batch: the planner counts per token)."""
    import torch

    from t2train.model.build import build_model_chunks, transformer_config

    tf_config = transformer_config(config)
    tf_config.params_dtype = torch.bfloat16
    torch.manual_seed(0)
    [model] = build_model_chunks(config, tf_config, vocab_size=16)
    model.to(torch.bfloat16)
    hidden = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
    rope = model.rotary_pos_emb(S)
    skipped = {t.untyped_storage().data_ptr() for t in (rope, *model.parameters())}
    saved, counting = {}, [True]

    def keep(t):
        storage = t.untyped_storage()
        per_token = max(t.shape, default=0) >= S  # the hidden size is below S here
        if counting[0] and per_token and storage.data_ptr() not in skipped:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def layers_done(*_):  # the decoder's final norm runs after the last layer, eagerly
        counting[0] = False

    model.decoder.final_layernorm.register_forward_pre_hook(layers_done)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = model.decoder(hidden, None, rotary_pos_emb=rope)
    out.float().sum().backward()
    return sum(saved.values())


def _compiled(monkeypatch, config) -> int:
    """``_saved_by_compiled_layers``, each layer compiled afresh with Inductor's partitioner."""
    import torch

    from t2train.nn.compiling import BACKEND_VARIABLE

    monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager_decomp_partition")
    monkeypatch.setenv("T2_KERNELS", "triton")  # the Triton kernels' operators
    _launching_nothing(monkeypatch)
    torch._dynamo.reset()  # the layer's code compiled by other tests, with other backends
    try:
        return _saved_by_compiled_layers(config)
    finally:
        torch._dynamo.reset()


COMPILED_VARIANTS = {
    "standard": [],
    "query-groups": ["model.num_query_groups=1"],
    "query-groups+mixer": ["model.num_query_groups=2", "model.shortswa.window=8"],
    **{name: [f"model.residual={name}"] for name in registered() if name != BASELINE},
    "ddl-dv2": ["model.residual=ddl", "model.ddl.dv=2"],
    "hc-static": ["model.residual=hc", "model.hc.dynamic=false"],
    "mhc+mixer": ["model.residual=mhc", "model.shortswa.window=8"],
    "block_attnres+mixer": [  # a block closes mid-layer: its sum is kept twice
        "model.residual=block_attnres",
        "model.shortswa.window=8",
        "model.attnres.block_size=2",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(COMPILED_VARIANTS))
def test_the_planned_layer_is_what_the_compiled_layer_saves(megatron_world, monkeypatch, variant):
    """The compiled layers of a 2-layer bf16 decoder keep what the planner counts for them,
    `standard`'s layer and the design's ``saved_per_token``, to the byte (up to rounding)."""
    overrides = [*COMPILED_VARIANTS[variant], "model.num_layers=2", "model.fusions=all"]
    config = load_config(overrides=[*SHAPE, *overrides])
    measured = _compiled(monkeypatch, config)
    planned = 2 * S * B * layer_bytes_per_token(config.model, 1, False, 2)
    assert measured == pytest.approx(planned, abs=1), (measured / UNIT, planned / UNIT)


@pytest.mark.slow
@pytest.mark.parametrize("design", ["hc", "attnres"])
def test_full_recompute_keeps_the_packed_layer_inputs(megatron_world, monkeypatch, design):
    """The forward keeps each layer's packed input under full recompute, as the planner counts
    them; AttnRes' final read keeps the sources unpacked from the last checkpoint (the final
    state the planner adds) and one fp32 number per token, `hc`'s mean keeps nothing."""
    overrides = [f"model.residual={design}", "model.recompute=full", "model.num_layers=3"]
    config = load_config(overrides=[*SHAPE, *overrides, "model.fusions=all"])
    measured = _compiled(monkeypatch, config)
    final_read = (1 + 2 * 3) * UNIT + FP32_PER_TOKEN if design == "attnres" else 0
    assert measured == _packed_inputs(design, layers=3) * UNIT + final_read


def _selective_inputs(variant: str, layers: int) -> int:
    """Units of the layers' inputs under selective recompute, kept unpacked: each layer's
    state; `hc`'s first layer gets the embedding as n views of one unit, AttnRes' sources
    are one buffer holding the embedding and every sublayer's output (the last layer's
    too: the final read's input)."""
    if variant == "hc":
        return 1 + (layers - 1) * 4
    if variant == "attnres":
        return 1 + 2 * layers
    return layers


SELECTIVE_VARIANTS = {  # one of each kind of stream state, the mixer on one
    "query-groups+mixer": COMPILED_VARIANTS["query-groups+mixer"],
    "hc": ["model.residual=hc"],
    "attnres": ["model.residual=attnres"],
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(SELECTIVE_VARIANTS))
def test_selective_recompute_keeps_the_inputs_and_the_gemm_outputs(
    megatron_world, monkeypatch, variant
):
    """Selective recompute keeps each layer's input, its GEMMs' and attention's outputs (QKV,
    attention with its fp32 log-sum-exp, the output projection, SwiGLU's fc1; the MLP's fc2
    only where the design's write scales it, hc's) and nothing else, as the planner counts
    (``selective_layer_bytes_per_token``): what a policy that kept nothing, or everything,
    would not."""
    from t2train.bench.plan import selective_layer_bytes_per_token

    overrides = [*SELECTIVE_VARIANTS[variant], "model.num_layers=2", "model.fusions=all"]
    config = load_config(overrides=[*SHAPE, *overrides, "model.recompute=selective"])
    measured = _compiled(monkeypatch, config)
    kept = 2 * S * B * selective_layer_bytes_per_token(config.model, 1, False, 2)
    expected = _selective_inputs(variant, layers=2) * UNIT + kept
    assert measured == pytest.approx(expected, abs=1), (measured / UNIT, expected / UNIT)


@pytest.mark.parametrize("design", ["standard", "hc", "attnres", "block_attnres", "depth_attn"])
@pytest.mark.parametrize("layout", [[], ["parallel.tensor=2", "parallel.sequence_parallel=true"]])
def test_selective_recompute_is_planned_between_full_and_none(design, layout):
    """Per stage, selective recompute keeps more than full recompute (the GEMM outputs
    beside the inputs) and less than none (the pointwise work is rebuilt)."""
    on = [f"model.residual={design}", "model.attnres.block_size=2", *layout]
    tp = 2 if layout else 1
    planned = {
        mode: _activations(*on, f"model.recompute={mode}", tp=tp)
        for mode in ("none", "selective", "full")
    }
    assert planned["full"] < planned["selective"] < planned["none"], planned
