"""``model.mhc.recompute_streams``: the n streams between a layer's sublayers are dropped after
the forward and rebuilt in the backward (mHC's recomputation, arXiv 2512.24880 Sec. 4.3). It
changes no value and keeps fewer bytes for the backward (kernels' path, Triton interpreter)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from t2train.config.loader import load_config
from t2train.config.schema import ConfigError
from t2train.model.build import build_model_chunks, transformer_config
from t2train.residual.mhc import layers as mhc

SHAPE = [
    "data.path=unused",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.seq_length=16",
    "model.ffn_hidden_size=48",
    "model.residual=mhc",
    "model.mhc.sinkhorn_iterations=5",
]
SEQ, BATCH, HIDDEN = 16, 2, 32
LAYERS, STREAMS = 2, 4  # the default expansion rate


def _run(recompute: bool, dtype, mixer: bool = True):
    """Loss, the input's and every decoder parameter's gradient, and the bytes (distinct
    storages) autograd keeps: what the outer hook sees, what the states' hook keeps as
    tensors, and what its recipes hold."""
    config = load_config(
        overrides=SHAPE
        + [
            f"model.mhc.recompute_streams={str(recompute).lower()}",
            f"model.shortswa.window={3 if mixer else 0}",
        ]
    )
    tf_config = transformer_config(config)
    tf_config.params_dtype = dtype
    torch.manual_seed(0)
    [model] = build_model_chunks(config, tf_config, vocab_size=16)
    with torch.no_grad():
        for param in model.decoder.parameters():
            param.add_(0.1 * torch.randn_like(param))
    hidden = torch.randn(SEQ, BATCH, HIDDEN, dtype=dtype, requires_grad=True)
    storages = {}

    def keep(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    states_pack = mhc.DROPPED_STATES.pack

    def pack(t):
        saved = states_pack(t)
        for kept in saved.inputs if isinstance(saved, mhc._Recomputed) else (saved,):
            if isinstance(kept, torch.Tensor):
                keep(kept)
        return saved

    params = list(model.decoder.parameters())
    with (
        mock.patch.dict(os.environ, {"T2_KERNELS": "triton"}),
        mock.patch.object(mhc.DROPPED_STATES, "pack", pack),
    ):
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = model.decoder(hidden, None, rotary_pos_emb=model.rotary_pos_emb(SEQ))
        loss = out.float().pow(2).mean()
        grads = torch.autograd.grad(loss, [hidden, *params])
    return loss, grads, sum(storages.values())


def test_recomputing_the_streams_changes_no_value(megatron_world):
    """With the mixer: two states dropped per layer, the second rebuilt from the first."""
    loss, grads, _ = _run(False, torch.float32)
    loss_rc, grads_rc, _ = _run(True, torch.float32)
    assert loss_rc == loss  # the same kernels on the same inputs: bitwise
    for index, (a, b) in enumerate(zip(grads, grads_rc)):
        torch.testing.assert_close(b, a, atol=0, rtol=0, msg=lambda m, i=index: f"{i}: {m}")


@pytest.mark.parametrize("mixer", [True, False], ids=["with_mixer", "alone"])
def test_recomputing_the_streams_keeps_fewer_bytes(megatron_world, mixer):
    """Exactly the states between a layer's sublayers are no longer kept: 2 per layer with
    the mixer (3 sublayers), 1 without; each n x [s, b, h] in bf16 (measured: 382,088 ->
    349,320 bytes with the mixer, 0.914x at these tiny widths)."""
    *_, kept = _run(False, torch.bfloat16, mixer)
    *_, kept_rc = _run(True, torch.bfloat16, mixer)
    print(
        f"saved for the backward: {kept} bytes, recomputing the streams {kept_rc} "
        f"({kept_rc / kept:.3f})"
    )
    state = STREAMS * SEQ * BATCH * HIDDEN * 2
    assert kept - kept_rc == LAYERS * (2 if mixer else 1) * state


def test_the_option_is_a_boolean():
    with pytest.raises(ConfigError, match="model.mhc.recompute_streams"):
        load_config(overrides=SHAPE + ["model.mhc.recompute_streams=2"])
