"""`t2train plan`'s activation memory: the layer's against what the compiled layer saves for its
backward, and beyond it the local mixer's sublayer across tensor ranks, a residual stream wider
than one unit, and the logits, each written out again here from its definition
(t2train/bench/plan.py's docstring)."""

from __future__ import annotations

import pytest

from t2train.bench.plan import layer_bytes_per_token, plan_layout
from t2train.config.loader import load_config

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


@pytest.mark.parametrize("n", [2, 4])
def test_a_stream_of_n_units_keeps_every_sublayers_new_state(n):
    """mHC's n streams all change at every write: (n - 1) units beyond standard's one per
    sublayer (attention and MLP, and the mixer's when on)."""
    added = _activations("model.residual=mhc", f"model.mhc.expansion_rate={n}") - _activations()
    assert added == pytest.approx(L * 2 * (n - 1) * UNIT, abs=2)
    mixed = _activations(
        "model.residual=mhc", f"model.mhc.expansion_rate={n}", "model.shortswa.window=8"
    ) - _activations("model.shortswa.window=8")
    assert mixed == pytest.approx(L * 3 * (n - 1) * UNIT, abs=2)


def test_attention_residuals_keep_each_source_once():
    """Full AttnRes makes one source per sublayer (and the embedding): kept until backward,
    one unit each, spread over the layers."""
    added = _activations("model.residual=attnres") - _activations()
    assert added == pytest.approx((2 * L + 1) * UNIT, abs=2 * L)


def test_the_last_stage_holds_the_logits_and_their_gradient():
    assert _activations(vocab=2 * V) - _activations() == 2 * S * B * V * 2


def _saved_by_compiled_layers(config) -> int:
    """Bytes of the distinct storages autograd keeps during the layers' forward (parameters and
    the shared RoPE table aside) of a bf16 decoder whose layers are compiled as on a GPU:
    Inductor's min-cut partition of what to save, with its decompositions (generating no
    kernels), and the Triton kernels under the interpreter."""
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
        if counting[0] and storage.data_ptr() not in skipped:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def layers_done(*_):  # the decoder's final norm runs after the last layer, eagerly
        counting[0] = False

    model.decoder.final_layernorm.register_forward_pre_hook(layers_done)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = model.decoder(hidden, None, rotary_pos_emb=rope)
    out.float().sum().backward()
    return sum(saved.values())


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [(), ("model.num_query_groups=1",), ("model.num_query_groups=2", "model.shortswa.window=8")],
    ids=["standard", "query-groups", "query-groups+mixer"],
)
def test_the_planned_layer_is_what_the_compiled_layer_saves(megatron_world, monkeypatch, variant):
    """Within 1% (the planner leaves out nothing larger than a rounding of its own): the
    compiled layers of a 2-layer decoder keep, in bf16, what the planner counts for them."""
    import torch

    from t2train.nn.compiling import BACKEND_VARIABLE

    monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager_decomp_partition")
    monkeypatch.setenv("T2_KERNELS", "triton")  # the mixer's window attention
    overrides = [*variant, "model.num_layers=2", "model.fusions=all"]
    config = load_config(overrides=[*SHAPE, *overrides])
    torch._dynamo.reset()  # the layer's code compiled by other tests, with other backends
    try:
        measured = _saved_by_compiled_layers(config)
    finally:
        torch._dynamo.reset()
    planned = 2 * S * B * layer_bytes_per_token(config.model, 1, False, 2)
    assert measured == pytest.approx(planned, rel=0.01), (measured / (S * B * H * 2), planned)
