"""Every residual design, alone and with the local ShortSWA mixer, builds inside the Megatron
decoder with the parameters and FLOPs it claims."""

import pytest
import torch

from t2train.config.loader import load_config
from t2train.config.schema import ConfigError
from t2train.model.build import build_model_chunks, transformer_config
from t2train.model.flops import (forward_flops_per_token, parameters,
                                 standard_forward_flops_per_token)
from t2train.residual import registered

BASE = ["data.path=unused", "model.num_layers=3", "model.hidden_size=64",
        "model.num_attention_heads=4", "model.seq_length=16", "model.tie_embeddings=false"]
MIXER = ["model.shortswa.window=4"]
VARIANTS = {  # name: (design, overrides)
    "standard": ("standard", []), "ddl": ("ddl", []), "ddl_dv4": ("ddl", ["model.ddl.dv=4"]),
    "depth_attn": ("depth_attn", ["model.depth_attn.window=2"]), "attnres": ("attnres", []),
    "block_attnres": ("block_attnres", ["model.attnres.block_size=3"]),
    "standard+shortswa": ("standard", MIXER), "ddl+shortswa": ("ddl", MIXER),
    "ddl_dv4+shortswa": ("ddl", ["model.ddl.dv=4", *MIXER]),
    "depth_attn+shortswa": ("depth_attn", ["model.depth_attn.window=2", *MIXER]),
    "attnres+shortswa": ("attnres", MIXER),
    "block_attnres+shortswa": ("block_attnres", ["model.attnres.block_size=3", *MIXER]),
    "hc": ("hc", []), "hc_static": ("hc", ["model.hc.dynamic=false"]),
    "hc_n1": ("hc", ["model.hc.expansion_rate=1"]), "mhc": ("mhc", []),
    "mhc_n3": ("mhc", ["model.mhc.expansion_rate=3", "model.mhc.sinkhorn_iterations=5"]),
    "hc+shortswa": ("hc", MIXER), "hc_static+shortswa": ("hc", ["model.hc.dynamic=false", *MIXER]),
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


@pytest.mark.parametrize("variant", VARIANTS)
def test_trains_a_step_with_finite_gradients(megatron_world, variant):
    model = _build(_config(variant))
    tokens, labels, positions = _batch()
    loss = model(tokens, positions, None, labels=labels).mean()
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_extra_flops_are_zero_only_for_standard():
    for variant in VARIANTS:
        model = _config(variant).model
        extra = forward_flops_per_token(model, 128) - standard_forward_flops_per_token(model, 128)
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
    full, block, missing = _shared_logits("attnres", "block_attnres",
                                          extra_b=["model.attnres.block_size=1"])
    assert not missing
    torch.testing.assert_close(block, full, atol=1e-6, rtol=1e-6)


def test_block_attnres_with_larger_blocks_differs(megatron_world):
    full, block, _ = _shared_logits("attnres", "block_attnres")
    assert not torch.allclose(block, full)


def test_shortswa_window_covering_the_sequence_is_full_attention(megatron_world):
    from megatron.core.transformer.enums import AttnMaskType

    from t2train.nn.attention import CausalCoreAttention
    from t2train.residual.shortswa import ShortWindowCoreAttention

    config = transformer_config(_config("standard+shortswa", "model.shortswa.window=16"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 2, 4, 16, generator=g) for _ in range(3))
    args = (config, 1, AttnMaskType.causal, "self")
    full = CausalCoreAttention(*args)(q, k, v, None)
    torch.testing.assert_close(ShortWindowCoreAttention(*args)(q, k, v, None), full)
    config.t2_model.shortswa.window = 4
    assert not torch.allclose(ShortWindowCoreAttention(*args)(q, k, v, None), full)


@pytest.mark.parametrize("override, message", [
    ("model.ddl.dv=0", "model.ddl.dv=0: must be >= 1"),
    ("model.ddl.beta_init=2.0", "model.ddl.beta_init=2.0: must be in (0, 2)"),
    ("model.shortswa.window=-1", "model.shortswa.window=-1: must be >= 0"),
    ("model.depth_attn.window=0", "model.depth_attn.window=0: must be >= 1"),
])
def test_invalid_options(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=BASE + [override])
    assert message in str(err.value)


def test_block_size_must_divide_the_sublayers():
    with pytest.raises(ConfigError, match="model.attnres.block_size=4: must divide"):
        load_config(overrides=BASE + ["model.residual=block_attnres",
                                      "model.attnres.block_size=4"])


def test_expanded_ddl_refuses_sequence_parallelism():
    with pytest.raises(ConfigError, match="parallel.sequence_parallel=True: is not supported"):
        load_config(overrides=BASE + ["model.residual=ddl", "model.ddl.dv=4", "parallel.tensor=2",
                                      "parallel.sequence_parallel=true"])
