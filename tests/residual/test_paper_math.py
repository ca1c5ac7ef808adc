"""Every design's decoder computes its paper's formula: outputs and gradients, in fp64.

The model is built as training builds it (``build_model_chunks``), at fp64, with every weight
moved off its initial value (non-zero W_O of the depth read, non-zero pseudo-queries, DDL
gates spread over both beta < 1 and beta > 1, v away from saturation, a random EC conv and
CC mixes). Its decoder (embedding in, final norm out, rotary embedding off: positions are
not part of any design) runs 3 layers on 6 tokens x 2 sequences of width 8, and must equal
the formulas written out again in ``paper_math.py`` to 1e-10, in value and in the gradient
of every parameter and of the input. 3 layers make the depth windows slide and the AttnRes
blocks close inside a layer; 6 tokens make the ShortSWA window (3) cut.

The same comparison with the Triton kernels (``T2_KERNELS=triton``, fp32 under the
interpreter) pins the kernels to the papers too, and the dispatch counter proves they ran.
"""

from __future__ import annotations

import paper_math as paper
import pytest
import torch
from built import BATCH, EPS, HEADS, HIDDEN, LAYERS, SEQ, build_decoder, random

from t2train.kernels import dispatch

SWA_WINDOW, DEPTH_WINDOW, BLOCK = 3, 2, 3
DDL = dict(k_eps=1e-5, v_scale=4.0)
ATTNRES_EPS = 1e-6

# variant -> (config overrides, the paper's decoder, the kernel calls of one forward)
CASES = {
    "standard": ([], lambda p, x, t: paper.standard_decoder(p, x, LAYERS, HEADS, EPS), {}),
    "ddl": (
        ["model.residual=ddl"],
        lambda p, x, t: paper.ddl_decoder(p, x, LAYERS, HEADS, EPS, 1, trace=t, **DDL),
        {"delta_write": 2 * LAYERS, "fp32_linear": 4 * LAYERS},
    ),  # and 2 gate logits a write
    "ddl_dv4": (
        ["model.residual=ddl", "model.ddl.dv=4"],
        lambda p, x, t: paper.ddl_decoder(p, x, LAYERS, HEADS, EPS, 4, trace=t, **DDL),
        {"delta_write": 2 * LAYERS, "fp32_linear": 4 * LAYERS},
    ),
    "shortswa": (
        ["model.residual=shortswa", f"model.shortswa.window={SWA_WINDOW}"],
        lambda p, x, t: paper.shortswa_decoder(p, x, LAYERS, HEADS, EPS, SWA_WINDOW),
        {"window_attention": LAYERS},
    ),
    "depth_attn": (
        ["model.residual=depth_attn", f"model.depth_attn.window={DEPTH_WINDOW}"],
        lambda p, x, t: paper.depth_attn_decoder(p, x, LAYERS, HEADS, EPS, DEPTH_WINDOW, t),
        {"window_attention": LAYERS},
    ),
    "attnres": (
        ["model.residual=attnres"],
        lambda p, x, t: paper.attnres_decoder(
            p, x, LAYERS, HEADS, EPS, 1, ATTNRES_EPS, t
        ),  # every sublayer's read a phase 1 (handing the sources on), the final read a mixture
        {"block_phase_1": 2 * LAYERS, "depth_mix": 1},
    ),
    "block_attnres": (
        ["model.residual=block_attnres", f"model.attnres.block_size={BLOCK}"],
        lambda p, x, t: paper.attnres_decoder(p, x, LAYERS, HEADS, EPS, BLOCK, ATTNRES_EPS, t),
        # a block's first read runs phase 1 for the block, the others phase 2
        {
            "block_phase_1": 2 * LAYERS // BLOCK,
            "block_phase_2": 2 * LAYERS - 2 * LAYERS // BLOCK,
            "depth_mix": 1,
        },
    ),
}


def run_both(variant: str, dtype, trace=None):
    """(model output, paper output, model grads, paper grads) for one upstream gradient;
    grads of the input, then of every parameter by name. The paper side runs in fp64."""
    decoder = build_decoder(CASES[variant][0], dtype)
    params = dict(decoder.named_parameters())
    x = random(SEQ, BATCH, HIDDEN, dtype=dtype).requires_grad_()
    out = decoder(x, None, rotary_pos_emb=None)
    p64 = {name: t.detach().double().requires_grad_() for name, t in params.items()}
    x64 = x.detach().double().requires_grad_()
    expected = CASES[variant][1](p64, x64, trace)
    upstream = random(SEQ, BATCH, HIDDEN, seed=2)
    got = torch.autograd.grad(out, [x, *params.values()], upstream.to(dtype))
    want = torch.autograd.grad(expected, [x64, *p64.values()], upstream, allow_unused=True)
    names = ["input", *params]
    return out, expected, dict(zip(names, got)), dict(zip(names, want))


# A first-layer read over a single source (AttnRes: the embedding; depth read: h^(0)) gives it
# weight 1 whatever the query: the query has no gradient by the formula.
INERT = {
    "attnres": "layers.0.attn_residual.query",
    "block_attnres": "layers.0.attn_residual.query",
    "depth_attn": "layers.0.layer_entry.linear_q.weight",
}


def assert_same(variant, out, expected, got, want, tol):
    """Within ``tol`` times the largest magnitude (per tensor); every parameter but the inert
    one has a gradient well above that."""

    def close(a, b, what):
        bound = tol * max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double(), b, atol=bound, rtol=0, msg=lambda m: f"{what}: {m}")

    close(out, expected, "output")
    for name, grad in got.items():
        assert want[name] is not None, f"{name} is not part of the paper's formula"
        close(grad, want[name], f"gradient of {name}")
        assert (want[name].abs().max() > 1e-3) == (name != INERT.get(variant)), name


@pytest.mark.parametrize("variant", CASES)
def test_decoder_follows_the_paper_in_fp64(megatron_world, monkeypatch, variant):
    monkeypatch.setenv("T2_KERNELS", "torch")
    dispatch.reset_launches()
    trace = []
    assert_same(variant, *run_both(variant, torch.float64, trace), tol=1e-10)
    assert not dispatch.launches
    check_regimes(variant, trace)


def check_regimes(variant: str, trace: list) -> None:
    """The weights put each design where a wrong formula shows: gates on both sides of 1 and
    v unsaturated (DDL); read weights far from uniform (depth read, AttnRes)."""
    if variant.startswith("ddl"):
        beta = torch.cat([b.flatten() for b, _ in trace])
        v = torch.cat([v.flatten() for _, v in trace]) / DDL["v_scale"]
        assert beta.min() < 0.7 and beta.max() > 1.3, (beta.min(), beta.max())
        assert 0.05 < v.min() and v.max() < 0.95, (v.min(), v.max())
    elif variant in ("depth_attn", "attnres", "block_attnres"):
        spread = max(w.max() - w.min() for w in trace if len(w) > 1)
        assert spread > 0.3, spread


@pytest.mark.parametrize("variant", [v for v in CASES if CASES[v][2]])
def test_decoder_with_kernels_follows_the_paper(megatron_world, monkeypatch, variant):
    """fp32 Triton kernels (interpreter on CPU) against the fp64 formulas, to fp32 accuracy:
    1e-4 of the largest entry (the fp32 references are off by up to 1.2e-5 of it, the
    kernels by 1e-5; the kernel tests hold kernel and reference to 1e-5)."""
    monkeypatch.setenv("T2_KERNELS", "triton")
    dispatch.reset_launches()
    assert_same(variant, *run_both(variant, torch.float32), tol=1e-4)
    assert dict(dispatch.launches) == CASES[variant][2]
