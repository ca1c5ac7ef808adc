"""Residual designs compose with the local ShortSWA mixer (Residual Stream Duality, Sec. 2.4).

* the mixer's sublayer is written through the design's operator (DDL: its own delta write;
  AttnRes: a source of its own), checked against the formulas written out here;
* the former design `model.residual=shortswa` is an alias of standard + the mixer, and a
  checkpoint written while it was a design loads under both spellings with the same logits;
* combinations that cannot work are config errors naming both fields.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from t2train.checkpoint.compatibility import check_same_model
from t2train.checkpoint.errors import CheckpointError
from t2train.config.loader import load_config
from t2train.config.schema import ConfigError
from t2train.model.build import build_model_chunks, transformer_config
from t2train.residual import sublayer_names, variant_label

FIXTURE = Path(__file__).parent / "fixtures" / "old-shortswa-checkpoint"
SHAPE = [
    "data.path=unused",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=64",
    "model.seq_length=16",
    "model.vocab_size=128",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
]


def test_the_old_design_name_is_standard_with_the_mixer():
    old = load_config(overrides=[*SHAPE, "model.residual=shortswa"]).model
    assert (old.residual, old.shortswa.window, variant_label(old)) == (
        "standard",
        128,
        "standard+shortswa",
    )  # 128 was the design's default window
    kept = load_config(overrides=[*SHAPE, "model.residual=shortswa", "model.shortswa.window=4"])
    assert kept.model.shortswa.window == 4
    alone = load_config(overrides=[*SHAPE, "model.residual=ddl"]).model
    assert (alone.shortswa.window, variant_label(alone), sublayer_names(alone)) == (
        0,
        "ddl",
        ("attn", "mlp"),
    )
    mixed = load_config(overrides=[*SHAPE, "model.residual=ddl", "model.shortswa.window=8"])
    assert (variant_label(mixed.model), sublayer_names(mixed.model)) == (
        "ddl+shortswa",
        ("shortswa", "attn", "mlp"),
    )


@pytest.mark.parametrize(
    "spelling",
    [
        ["model.residual=shortswa", "model.shortswa.window=4"],
        ["model.residual=standard", "model.shortswa.window=4"],
    ],
)
def test_a_checkpoint_of_the_former_design_loads_with_its_logits(megatron_world, spelling):
    from t2train.engine.megatron import MegatronEngine
    from t2train.engine.megatron.checkpoint import load_checkpoint

    config = load_config(overrides=[*SHAPE, *spelling])
    engine = MegatronEngine(config, vocab_size=128)
    load_checkpoint(FIXTURE / "step_00000000", engine.objs, config)
    expected = torch.load(FIXTURE / "expected_logits.pt")
    model = engine.model[0].module
    model.eval()
    with torch.no_grad():
        logits = model(expected["tokens"], torch.arange(16).expand(2, 16), None)
    torch.testing.assert_close(logits, expected["logits"], atol=1e-6, rtol=1e-6)


def test_a_mixer_window_of_a_format_1_checkpoint_meant_nothing_without_the_old_name():
    """Before the mixer was an axis, every config carried shortswa.window=128 unused."""
    ddl = load_config(overrides=[*SHAPE, "model.residual=ddl"]).model
    saved = dict(asdict(ddl), shortswa={"window": 128})
    check_same_model(Path("old"), {"config": {"model": saved}}, ddl)  # format 1: no mixer
    with pytest.raises(CheckpointError, match="model.shortswa.window: checkpoint 128, this run 0"):
        check_same_model(Path("new"), {"config": {"model": saved}, "config_format": 2}, ddl)


def test_initial_values_may_change_on_resume_and_shapes_may_not():
    """The options a design declares not_architecture (its initial values) may differ from
    the checkpoint's, or be missing from an older one; its shapes may not."""
    mhc = load_config(overrides=[*SHAPE, "model.residual=mhc", "model.shortswa.window=4"]).model
    saved = asdict(mhc)
    saved["mhc"] = dict(saved["mhc"], gate_init=0.5)
    saved["shortswa"] = {"window": 4}  # written before zero_init_output existed
    check_same_model(Path("older"), {"config": {"model": saved}, "config_format": 2}, mhc)
    saved["mhc"]["expansion_rate"] = 3
    with pytest.raises(CheckpointError, match="model.mhc.expansion_rate: checkpoint 3, this run 4"):
        check_same_model(Path("other"), {"config": {"model": saved}, "config_format": 2}, mhc)


def _layer_and_inputs(design: str, *extra: str):
    """Layer 1 of a one-layer fp64 model, every parameter moved off its initial value."""
    config = load_config(
        overrides=[
            *SHAPE,
            "model.num_layers=1",
            f"model.residual={design}",
            "model.shortswa.window=3",
            *extra,
        ]
    )
    torch.manual_seed(0)
    [model] = build_model_chunks(config, transformer_config(config), vocab_size=128)
    model = model.double()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(16, 2, 32, dtype=torch.float64, generator=g)  # [s, b, h]
    return model.decoder.layers[0], hidden, model.rotary_pos_emb(16)


def _sublayer(module, normed: torch.Tensor, rope) -> torch.Tensor:
    out, bias = module(normed, attention_mask=None, rotary_pos_emb=rope)
    return out if bias is None else out + bias


def test_ddl_with_shortswa_writes_each_of_three_sublayers_through_its_own_delta(megatron_world):
    """X <- X + beta k (v - k^T X), k = F(c)/sqrt(|F(c)|^2 + eps^2), beta = 2 sigmoid(w.c + b),
    v = 4 sigmoid(W_v X + b_v), c = Norm(X), for F = ShortSWA, then attention, then the MLP."""
    layer, hidden, rope = _layer_and_inputs("ddl")

    def delta(x, residual, norm, mixer):
        c = norm(x)
        f = mixer(c)
        k = f / torch.sqrt((f * f).sum(-1, keepdim=True) + 1e-5**2)
        beta = 2 * torch.sigmoid(c @ residual.beta_proj.weight.T + residual.beta_proj.bias)
        v = 4 * torch.sigmoid(x @ residual.v_proj.weight.T + residual.v_proj.bias)
        return x + beta * k * (v - (k * x).sum(-1, keepdim=True))

    x = delta(
        hidden,
        layer.pre_attention_residual,
        layer.pre_attention_layernorm,
        lambda c: _sublayer(layer.pre_attention, c, rope),
    )
    x = delta(
        x,
        layer.attn_residual,
        layer.input_layernorm,
        lambda c: _sublayer(layer.self_attention, c, rope),
    )
    x = delta(
        x,
        layer.mlp_residual,
        layer.pre_mlp_layernorm,
        lambda c: _sublayer(lambda n, **_: layer.mlp(n), c, rope),
    )
    torch.testing.assert_close(layer(hidden, None, rope), x, atol=1e-12, rtol=0)
    assert (
        len(
            {
                id(r.beta_proj.weight)
                for r in (layer.pre_attention_residual, layer.attn_residual, layer.mlp_residual)
            }
        )
        == 3
    )


def test_attnres_with_shortswa_makes_the_mixer_output_a_source(megatron_world):
    """h_l = sum_i softmax_i(w_l . RMSNorm(v_i)) v_i over the embedding and every earlier
    sublayer output, ShortSWA's included (three reads and three sources per layer)."""
    layer, hidden, rope = _layer_and_inputs("attnres")
    from t2train.residual.attnres import sources as source_buffer
    from t2train.residual.attnres.layers import AttnResState

    def mix(query, sources):
        stacked = torch.stack(sources)
        keys = stacked / torch.sqrt(stacked.pow(2).mean(-1, keepdim=True) + 1e-6)
        weights = torch.softmax(keys @ query, dim=0)
        return (weights.unsqueeze(-1) * stacked).sum(0)

    sources = [hidden]
    for residual, norm, run in (
        (
            layer.pre_attention_residual,
            layer.pre_attention_layernorm,
            lambda n: _sublayer(layer.pre_attention, n, rope),
        ),
        (
            layer.attn_residual,
            layer.input_layernorm,
            lambda n: _sublayer(layer.self_attention, n, rope),
        ),
        (layer.mlp_residual, layer.pre_mlp_layernorm, lambda n: layer.mlp(n)[0]),
    ):
        sources.append(run(norm(mix(residual.query, sources))))
    state = layer(AttnResState(*source_buffer.start([hidden], 4)), None, rope)
    assert (state.earlier.shape[0], len(state.new), state.partial) == (1, 3, None)
    for got, want in zip([*state.earlier, *state.new], sources):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert [
        r.index for r in (layer.pre_attention_residual, layer.attn_residual, layer.mlp_residual)
    ] == [0, 1, 2]


def test_block_sizes_count_the_mixer_sublayer():
    mixed = ["model.residual=block_attnres", "model.num_layers=3", "model.shortswa.window=4"]
    load_config(overrides=[*SHAPE, *mixed, "model.attnres.block_size=3"])  # 9 sublayers
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[*SHAPE, *mixed, "model.attnres.block_size=2"])
    assert (
        "model.attnres.block_size=2: must divide the number of sublayers 3 x "
        "model.num_layers = 9" in str(err.value)
    )
    assert "model.shortswa.window=4 adds a sublayer per layer" in str(err.value)
