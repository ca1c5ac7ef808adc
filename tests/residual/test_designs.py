"""Every residual design, alone and with the local ShortSWA mixer, builds inside the Megatron
decoder with the parameters and FLOPs it claims, starts where its design says
(zero-initialised reads, exact gradients at init) and keeps its structure (AttnRes sources per
layer, the ShortSWA band)."""

import paper_math as paper
import pytest
import torch

from t2train.config.loader import load_config
from t2train.config.schema import ConfigError
from t2train.model.build import build_model_chunks, transformer_config
from t2train.model.flops import (
    forward_flops_per_token,
    parameters,
    plain_forward_flops_per_token,
)
from t2train.residual import registered

BASE = [
    "data.path=unused",
    "model.num_layers=3",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=16",
    "model.tie_embeddings=false",
]
MIXER = ["model.shortswa.window=4"]
VARIANTS = {  # name: (design, overrides)
    "standard": ("standard", []),
    "ddl": ("ddl", []),
    "ddl_dv4": ("ddl", ["model.ddl.dv=4"]),
    "depth_attn": ("depth_attn", ["model.depth_attn.window=2"]),
    "attnres": ("attnres", []),
    "block_attnres": ("block_attnres", ["model.attnres.block_size=3"]),
    "standard+shortswa": ("standard", MIXER),
    "ddl+shortswa": ("ddl", MIXER),
    "ddl_dv4+shortswa": ("ddl", ["model.ddl.dv=4", *MIXER]),
    "depth_attn+shortswa": ("depth_attn", ["model.depth_attn.window=2", *MIXER]),
    "attnres+shortswa": ("attnres", MIXER),
    "block_attnres+shortswa": ("block_attnres", ["model.attnres.block_size=3", *MIXER]),
    "hc": ("hc", []),
    "hc_static": ("hc", ["model.hc.dynamic=false"]),
    "hc_n1": ("hc", ["model.hc.expansion_rate=1"]),
    "mhc": ("mhc", []),
    "mhc_n3": ("mhc", ["model.mhc.expansion_rate=3", "model.mhc.sinkhorn_iterations=5"]),
    "hc+shortswa": ("hc", MIXER),
    "hc_static+shortswa": ("hc", ["model.hc.dynamic=false", *MIXER]),
    "mhc+shortswa": ("mhc", MIXER),
}


def _config(variant: str, *extra: str):
    design, overrides = VARIANTS[variant]
    return load_config(overrides=BASE + [f"model.residual={design}", *overrides, *extra])


def _build(config, seed=0):
    torch.manual_seed(seed)
    [model] = build_model_chunks(config, transformer_config(config), vocab_size=128)
    return model


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(16).expand(2, 16)


def test_every_registered_design_is_covered_alone_and_with_the_mixer():
    alone = {design for name, (design, _) in VARIANTS.items() if "+" not in name}
    mixed = {design for name, (design, _) in VARIANTS.items() if "+" in name}
    assert set(registered()) == alone == mixed


@pytest.mark.parametrize("variant", VARIANTS)
def test_parameter_count_matches_the_module(megatron_world, variant):
    config = _config(variant)
    model = _build(config)
    assert sum(p.numel() for p in model.parameters()) == parameters(config.model, 128)


def test_each_sublayer_refers_to_its_pre_norm_without_owning_it(megatron_world):
    """``SublayerResidual.pre_norm`` is the norm the layer applies to the sublayer's input,
    and the norm's weight stays the layer's alone: no second state-dict entry."""
    model = _build(_config("ddl+shortswa"))
    layer = model.decoder.layers[0]
    norms = [layer.pre_attention_layernorm, layer.input_layernorm, layer.pre_mlp_layernorm]
    assert [r.pre_norm for r in layer.sublayer_residuals()] == norms
    assert len({id(n) for n in norms}) == 3
    assert not [key for key in model.state_dict() if "residual" in key and "norm" in key]


def test_each_sublayer_refers_to_the_one_that_follows_it_without_owning_it(megatron_world):
    """``SublayerResidual.following`` is the next sublayer's residual within the layer (the
    last's is None), a reference: the state dict names each residual's parameters once."""
    model = _build(_config("hc+shortswa"))
    layer = model.decoder.layers[0]
    residuals = layer.sublayer_residuals()
    assert [r.following for r in residuals] == [*residuals[1:], None]
    assert not [key for key in model.state_dict() if "following" in key]


# Parameters without a gradient at initialisation, by design: the depth read's output
# projection W_O starts at zero, so nothing before it gets a gradient; the first AttnRes read
# mixes one source (the embedding) with weight 1, so its query has no effect.
NO_GRADIENT_AT_INIT = {
    "depth_attn": {
        f"decoder.layers.{i}.layer_entry.{name}.weight"
        for i in range(3)
        for name in ("norm", "linear_q", "linear_kv")
    },
    "attnres": {"decoder.layers.0.attn_residual.query"},
    "block_attnres": {"decoder.layers.0.attn_residual.query"},
}
NO_GRADIENT_AT_INIT["depth_attn+shortswa"] = NO_GRADIENT_AT_INIT["depth_attn"]


def _dynamic_hc_inert(residuals: tuple) -> set:
    """Dynamic HC's weight projections start at zero (the paper's init), so tanh(W Norm(x))
    is 0: the scales multiplying it and the norm before it get no gradient at init."""
    return {
        f"decoder.layers.{i}.{residual}.{name}"
        for i in range(3)
        for residual in residuals
        for name in ("dynamic_alpha_scale", "dynamic_beta_scale", "norm.weight")
    }


NO_GRADIENT_AT_INIT["hc"] = NO_GRADIENT_AT_INIT["hc_n1"] = _dynamic_hc_inert(
    ("attn_residual", "mlp_residual")
)
NO_GRADIENT_AT_INIT["hc+shortswa"] = _dynamic_hc_inert(
    ("pre_attention_residual", "attn_residual", "mlp_residual")
)
for variant in ("attnres+shortswa", "block_attnres+shortswa"):  # the mixer reads first
    NO_GRADIENT_AT_INIT[variant] = {"decoder.layers.0.pre_attention_residual.query"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_step_at_init_reaches_exactly_the_parameters_it_should(megatron_world, variant):
    model = _build(_config(variant))
    tokens, labels, positions = _batch()
    loss = model(tokens, positions, None, labels=labels).mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    without = {
        name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().max() > 0
    }
    assert without == NO_GRADIENT_AT_INIT.get(variant, set())


def test_extra_flops_are_zero_only_for_standard():
    for variant in VARIANTS:
        model = _config(variant).model
        extra = forward_flops_per_token(model, 128) - plain_forward_flops_per_token(model, 128)
        assert (extra == 0) == (variant == "standard"), variant
        assert forward_flops_per_token(model, 128) > 0


def _shared_logits(variant_a: str, variant_b: str, extra_a=(), extra_b=()):
    """Logits of two designs whose shared parameters are copied from the first."""
    a = _build(_config(variant_a, *extra_a), seed=1)
    b = _build(_config(variant_b, *extra_b), seed=2)
    missing, _ = b.load_state_dict(a.state_dict(), strict=False)
    tokens, _, positions = _batch()
    return a(tokens, positions, None), b(tokens, positions, None), missing


def test_depth_attn_starts_as_standard(megatron_world):
    """W_O is zero-initialised, so the depth read adds nothing until it learns."""
    standard, depth, missing = _shared_logits("standard", "depth_attn")
    assert all("layer_entry" in key for key in missing)
    torch.testing.assert_close(depth, standard, atol=0, rtol=0)


def test_block_attnres_with_one_sublayer_blocks_is_full(megatron_world):
    full, block, missing = _shared_logits(
        "attnres", "block_attnres", extra_b=["model.attnres.block_size=1"]
    )
    assert not missing
    torch.testing.assert_close(block, full, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "variant, expected",
    [
        # (sources, partial sum open?) after each of the 3 layers (2 sublayers each)
        ("attnres", [(3, False), (5, False), (7, False)]),
        ("block_attnres", [(1, True), (2, True), (3, False)]),  # blocks of 3 sublayers
        # with the mixer: 3 sublayers per layer, so every layer closes a block of 3
        ("attnres+shortswa", [(4, False), (7, False), (10, False)]),
        ("block_attnres+shortswa", [(2, False), (3, False), (4, False)]),
    ],
)
def test_attnres_sources_after_each_layer(megatron_world, variant, expected):
    """Full: the embedding and every sublayer output. Block (S = 3): a block closes after
    sublayers 2 and 5 (0-based), so layer 2's MLP starts an open partial sum."""
    decoder = _build(_config(variant)).decoder
    state = decoder.stream.enter(torch.randn(16, 2, 64))
    for layer, (sources, partial) in zip(decoder.layers, expected):
        state = decoder.stream.between_layers(layer(state, None, None))
        assert (len(state.earlier), state.partial is not None) == (sources, partial)


def _core_attentions(window: int):
    """(ShortSWA's core attention, global attention's) of a built model with the mixer."""
    layer = _build(_config("standard+shortswa", f"model.shortswa.window={window}")).decoder.layers[
        0
    ]
    return layer.pre_attention.core_attention, layer.self_attention.core_attention


def test_shortswa_window_covering_the_sequence_is_full_attention(megatron_world):
    short, full = _core_attentions(16)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 2, 4, 16, generator=g) for _ in range(3))
    torch.testing.assert_close(short(q, k, v, None), full(q, k, v, None))


def test_shortswa_attends_to_the_last_w_tokens(megatron_world):
    """Token t sees tokens t-3 .. t (w = 4), softmax(q.k / sqrt(16)), per head (fp64)."""
    short, _ = _core_attentions(4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 2, 4, 16, generator=g, dtype=torch.float64) for _ in range(3))
    expected = torch.stack(
        [
            torch.cat(
                [
                    paper.window_attention_1d(q[:, b, h], k[:, b, h], v[:, b, h], 4, 1 / 4)
                    for h in range(4)
                ],
                dim=-1,
            )
            for b in range(2)
        ],
        dim=1,
    )
    torch.testing.assert_close(short(q, k, v, None), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.ddl.dv=0", "model.ddl.dv=0: must be >= 1"),
        ("model.ddl.beta_init=2.0", "model.ddl.beta_init=2.0: must be in (0, 2)"),
        ("model.shortswa.window=-1", "model.shortswa.window=-1: must be >= 0"),
        ("model.depth_attn.window=0", "model.depth_attn.window=0: must be >= 1"),
    ],
)
def test_invalid_options(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=BASE + [override])
    assert message in str(err.value)


def test_block_size_must_divide_the_sublayers():
    with pytest.raises(ConfigError, match="model.attnres.block_size=4: must divide"):
        load_config(overrides=BASE + ["model.residual=block_attnres", "model.attnres.block_size=4"])


def test_expanded_ddl_refuses_sequence_parallelism():
    with pytest.raises(ConfigError, match="parallel.sequence_parallel=True: is not supported"):
        load_config(
            overrides=BASE
            + [
                "model.residual=ddl",
                "model.ddl.dv=4",
                "parallel.tensor=2",
                "parallel.sequence_parallel=true",
            ]
        )


def test_the_mixer_multiplied_by_zero_is_exactly_standard(megatron_world):
    """With the ShortSWA sublayer's output multiplied by zero, `standard+shortswa` computes
    `standard`'s logits and gradients bit for bit (shared weights copied): the mixer
    composes with the plain residual by addition only, nothing else in the layer changes."""
    standard = _build(_config("standard"), seed=1)
    mixed = _build(_config("standard+shortswa"), seed=2)
    missing, unexpected = mixed.load_state_dict(standard.state_dict(), strict=False)
    assert not unexpected and all(".pre_attention" in key for key in missing)
    for layer in mixed.decoder.layers:
        layer.pre_attention.register_forward_hook(lambda m, args, out: (out[0] * 0, out[1]))
    tokens, labels, positions = _batch()
    for model in (standard, mixed):
        model(tokens, positions, None, labels=labels).sum().backward()
    torch.testing.assert_close(
        mixed(tokens, positions, None), standard(tokens, positions, None), atol=0, rtol=0
    )
    grads = dict(mixed.named_parameters())
    for name, param in standard.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, atol=0, rtol=0, msg=name)


def test_a_zero_initialised_mixer_starts_as_standard(megatron_world):
    """model.shortswa.zero_init_output: the ShortSWA output projection starts at zero, so the
    model starts with `standard`'s logits exactly (and only that projection differs)."""
    standard, mixed, missing = _shared_logits(
        "standard", "standard+shortswa", extra_b=["model.shortswa.zero_init_output=true"]
    )
    assert all(".pre_attention" in key for key in missing)
    torch.testing.assert_close(mixed, standard, atol=0, rtol=0)
