"""Block AttnRes in its two-phase form inside the model: the block's first read in a chunk runs
phase 1 for all of the block's reads there at once; every read then merges with the partial.

Checked against the one-read-at-a-time form (each read mixes its sources and partial alone,
``depth_mix``): same logits and gradients, fewer phase-1 launches (each routed call is one
forward kernel launch on CUDA).
"""

from collections import Counter

import pytest
import torch

from t2train.config.loader import load_config
from t2train.kernels import dispatch
from t2train.model.build import build_model_chunks, transformer_config
from t2train.residual.attnres.layers import BlockAttnResidual, mix_sources

BASE = [
    "data.path=unused",
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.seq_length=8",
    "model.tie_embeddings=false",
    "model.residual=block_attnres",
]
CASES = {  # name: (overrides, blocks of the 4-layer model)
    "S=4": (["model.attnres.block_size=4"], 2),  # 8 reads: 2 blocks of 4
    "S=2": (["model.attnres.block_size=2"], 4),
    "S=3+shortswa": (["model.attnres.block_size=3", "model.shortswa.window=4"], 4),  # 12 reads
}


def _one_read_at_a_time(self, state):
    return mix_sources(self.query, state.stacks(), state.partial, self.eps)


def _run(overrides, monkeypatch, batched: bool):
    """Logits, parameter gradients and the depth reads' routed calls of one forward and
    backward."""
    calls = Counter()
    route = dispatch.route

    def counted(kernel, *tensors):
        if kernel.name in ("block_phase_1", "block_phase_2", "depth_mix"):
            calls[kernel.name] += 1
        return route(kernel, *tensors)

    monkeypatch.setattr(dispatch, "route", counted)
    if not batched:
        monkeypatch.setattr(BlockAttnResidual, "read", _one_read_at_a_time)
    config = load_config(overrides=BASE + overrides)
    torch.manual_seed(0)
    [model] = build_model_chunks(config, transformer_config(config), vocab_size=64)
    with torch.no_grad():  # non-zero queries: the mixtures are not uniform
        for name, param in model.named_parameters():
            if "query" in name:
                param.normal_(std=0.5)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1], torch.arange(8).expand(2, 8), None)
    logits.pow(2).mean().backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    monkeypatch.undo()
    return logits.detach(), grads, calls


@pytest.mark.parametrize("case", CASES)
def test_batched_phase_1_matches_one_read_at_a_time(megatron_world, monkeypatch, case):
    overrides, blocks = CASES[case]
    logits, grads, calls = _run(overrides, monkeypatch, batched=True)
    want_logits, want_grads, single = _run(overrides, monkeypatch, batched=False)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-5, msg=name)
    assert any("query" in name and grad.abs().sum() > 0 for name, grad in grads.items())

    reads = 4 * (3 if "shortswa" in case else 2)
    # Kernel launches: one-at-a-time pays phase 1 per read (+ phase 2 if a partial exists);
    # batched pays phase 1 once per block, phase 2 per read after the block's first.
    with_partial = reads - blocks
    print(
        f"{case}: phase-1 launches {reads} -> {calls['block_phase_1']}, phase-2 "
        f"{with_partial} -> {calls['block_phase_2']} (+1 final read each)"
    )
    assert single == Counter(depth_mix=reads + 1)
    assert calls == Counter(block_phase_1=blocks, block_phase_2=with_partial, depth_mix=1)
