"""The probe recorder: free when off, model outputs unchanged when on, and the recorded
internals of every design are what they claim (gates in range, weights summing to one)."""

import math

import pytest
import torch

from t2train.config.loader import load_config
from t2train.model.build import build_model_chunks, transformer_config
from t2train.nn import probe
from t2train.residual.window_attention import (
    short_window_attention,
    window_attention_entropy,
    window_attention_probs,
)

LAYERS, SEQ = 3, 16
BASE = [
    "data.path=unused",
    f"model.num_layers={LAYERS}",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    f"model.seq_length={SEQ}",
]
VARIANTS = {
    "ddl": ["model.residual=ddl"],
    "ddl_dv4": ["model.residual=ddl", "model.ddl.dv=4"],
    "standard+shortswa": ["model.residual=standard", "model.shortswa.window=4"],
    "depth_attn": ["model.residual=depth_attn", "model.depth_attn.window=2"],
    "attnres": ["model.residual=attnres"],
    "block_attnres": ["model.residual=block_attnres", "model.attnres.block_size=3"],
    "hc": ["model.residual=hc"],
    "mhc+shortswa": ["model.residual=mhc", "model.shortswa.window=4"],
}


def test_record_does_nothing_outside_recording():
    def compute():
        raise AssertionError("computed while not recording")

    probe.record("kind", 1, compute)


def test_the_first_value_per_key_is_kept():
    with probe.recording() as records:
        probe.record("kind", 1, lambda: torch.tensor(1.0))
        probe.record("kind", 1, lambda: torch.tensor(2.0))
    assert records == {"kind": {1: torch.tensor(1.0)}}


def _model_and_batch(variant: str):
    config = load_config(overrides=BASE + VARIANTS[variant])
    torch.manual_seed(0)
    [model] = build_model_chunks(config, transformer_config(config), vocab_size=128)
    model.eval()
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
    return model, tokens, torch.arange(SEQ).expand(2, SEQ)


@pytest.mark.parametrize("variant", VARIANTS)
def test_recording_leaves_outputs_unchanged_and_records_the_design(megatron_world, variant):
    model, tokens, positions = _model_and_batch(variant)
    with torch.no_grad():
        plain = model(tokens, positions, None)
        with probe.recording() as records:
            recorded = model(tokens, positions, None)
    assert torch.equal(plain, recorded)

    if variant.startswith("ddl"):
        sublayers = {(layer, position) for layer in range(1, LAYERS + 1) for position in (0, 1)}
        assert set(records) == {"ddl_beta", "ddl_kx"}
        assert set(records["ddl_beta"]) == set(records["ddl_kx"]) == sublayers
        for beta in records["ddl_beta"].values():
            assert ((beta > 0) & (beta < 2)).all()
        dv = 4 if variant == "ddl_dv4" else 1
        for readout in records["ddl_kx"].values():
            assert readout.numel() == dv * SEQ * 2 and torch.isfinite(readout).all()
    elif variant == "standard+shortswa":
        assert set(records["shortswa_entropy"]) == set(range(1, LAYERS + 1))
        for entropy in records["shortswa_entropy"].values():
            assert 0 <= float(entropy) <= math.log(4) + 1e-6
    elif variant in ("hc", "mhc+shortswa"):
        name, positions = ("hc", (0, 1)) if variant == "hc" else ("mhc", (0, 1, 2))
        sublayers = {(layer, position) for layer in range(1, LAYERS + 1) for position in positions}
        kinds = {f"{name}_read", f"{name}_write", f"{name}_gain"}
        assert set(records) - {"shortswa_entropy"} == kinds
        assert all(set(records[kind]) == sublayers for kind in kinds)
        for (layer, position), read in records[f"{name}_read"].items():
            assert read.shape == (SEQ, 2, 4)
            if name == "hc":  # at init the k-th sublayer reads stream k mod 4 alone
                expected = torch.zeros(4)
                expected[(2 * (layer - 1) + position) % 4] = 1
                assert torch.equal(read, expected.expand(SEQ, 2, 4))
            else:
                assert ((read > 0) & (read < 1)).all()
        for write in records[f"{name}_write"].values():
            assert ((write > 0) & (write < 2)).all()
        for gain in records[f"{name}_gain"].values():  # A_r = I; H_res doubly stochastic
            assert float(gain) == pytest.approx(1.0, abs=1e-5)
    elif variant == "depth_attn":
        assert set(records["depth_attn"]) == set(range(1, LAYERS + 1))
        for layer, weights in records["depth_attn"].items():
            assert len(weights) == min(2, layer)  # window 2: itself and the state before
            assert float(weights.sum()) == pytest.approx(1.0)
    else:  # attnres, block_attnres: every sublayer read and the final read
        reads = records["attnres"]
        assert set(reads) == set(range(2 * LAYERS + 1))
        assert len(reads[0]) == 1 and len(reads[2 * LAYERS]) == (
            2 * LAYERS + 1 if variant == "attnres" else 1 + 2 * LAYERS // 3
        )
        for weights in reads.values():
            assert float(weights.sum()) == pytest.approx(1.0)


def test_explicit_window_weights_reproduce_the_operator():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, 8, generator=g)
    k, v = (torch.randn(2, 2, 24, 8, generator=g) for _ in range(2))  # grouped-query heads
    probs = window_attention_probs(q, k, window=5)
    torch.testing.assert_close(
        probs @ v.repeat_interleave(2, dim=1), short_window_attention(q, k, v, window=5)
    )
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)[:, :, -6:].mean()
    torch.testing.assert_close(window_attention_entropy(q, k, window=5, queries=6), entropy)
