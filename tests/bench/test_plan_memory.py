"""`t2train plan`'s activation memory beyond the standard layer of Korthikanti et al.: the local
mixer's sublayer, a residual stream wider than one unit, and the logits, each written out again
here from its definition (t2train/bench/plan.py's docstring)."""

from __future__ import annotations

import pytest

from t2train.bench.plan import plan_layout
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


def test_the_mixer_adds_an_attention_blocks_share_per_layer():
    for tp in (1, 2):
        added = _activations("model.shortswa.window=8", tp=tp) - _activations(tp=tp)
        assert added == pytest.approx(L * S * B * H * (5 + 9 / tp), abs=2), tp  # 2-byte units


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
