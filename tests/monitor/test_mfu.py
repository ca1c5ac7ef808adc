"""FLOPs behind MFU, checked against hand counts; the peak table and the MFU arithmetic.

The model: 2 layers, hidden 64, 4 heads (head dim 16, no GQA: K/V width 64), SwiGLU FFN 192
(8/3 x 64 rounded up to 64), sequence 64, padded vocabulary 128, tied embeddings.
"""

import pytest
import torch

from t2train.config.loader import load_config
from t2train.model.flops import forward_flops_per_token, plain_forward_flops_per_token
from t2train.monitor.mfu import (
    model_flops_per_token,
    peak_tflops,
    resolve_peak,
    tflops_per_device,
)

VOCAB = 128
BASE = [
    "data.path=unused",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
]

# Matmul weights N = layers x (QKV 64x192 + out 64x64 + SwiGLU 3x64x192) + LM head 128x64
#                  = 2 x (12288 + 4096 + 36864) + 8192 = 114688
# Causal attention, forward: QK^T and AV, 2 x 2 x 64 FLOPs per key, (64 + 1) / 2 keys on
# average, per layer; training is 3x: 6 x 2 x 64 x 65 = 49920.
STANDARD_TRAIN_FLOPS = 6 * 114688 + 49920

# Forward FLOPs each design adds, counted by hand (multiply-add = 2 FLOPs):
SHORTSWA_16 = 2 * (24576 + 8192 + 256 * 14.125)
EXTRA_FORWARD_FLOPS = {  # variant: (design, overrides, extra forward FLOPs per token)
    # 4 sublayers x (beta 2h + v 2h + k^T x 2h + rank-1 write 2h), h = 64
    "ddl": ("ddl", [], 4 * (4 * 128)),
    # 4 sublayers x (beta 2h + v, k^T X, write, compressor read 4 x 2h.dv each, dv = 4)
    # + embedding expander 2h.dv.kernel (kernel 4) + final read 2h.dv
    "ddl_dv4": ("ddl", ["model.ddl.dv=4"], 4 * (128 + 4 * 512) + 2048 + 512),
    # 2 layers x (QKV 2.64.192 + out 2.64.64 + scores and mix 4.64 x mean window); the window
    # of 16 gives (1 + 2 + ... + 16 + 48 x 16) / 64 = 14.125 keys per query on average
    "standard+shortswa": ("standard", ["model.shortswa.window=16"], SHORTSWA_16),
    # the mixer, and a delta write on each of 6 sublayers (3 per layer)
    "ddl+shortswa": ("ddl", ["model.shortswa.window=16"], SHORTSWA_16 + 6 * (4 * 128)),
    # layer 1 reads 1 state, layer 2 reads 2 (window 3): q and out 4h^2, K/V 4h^2 per state,
    # scores and mix 4h per state
    "depth_attn": (
        "depth_attn",
        ["model.depth_attn.window=3"],
        (16384 + 16384 + 256) + (16384 + 2 * 16384 + 2 * 256),
    ),
    # 5 reads (4 sublayers + final) over 1, 2, 3, 4, 5 sources, 6h FLOPs per source
    "attnres": ("attnres", [], (1 + 2 + 3 + 4 + 5) * 384),
    # the mixer, and 7 reads (6 sublayers + final) over 1 .. 7 sources
    "attnres+shortswa": ("attnres", ["model.shortswa.window=16"], SHORTSWA_16 + 28 * 384),
    # blocks of 2 sublayers: the reads see 1, 2 (emb + partial), 2 (emb + block),
    # 3 (emb + block + partial), 3 (emb + 2 blocks) sources
    "block_attnres": ("block_attnres", ["model.attnres.block_size=2"], (1 + 2 + 2 + 3 + 3) * 384),
    # n = 4 streams: 4 sublayers x (read 2nh 512 + stream mix 2n^2.h 2048 + write 2nh 512
    # + per-stream norms 2nh 512 + W_a, W_b 2nh(n + 2) 3072), then the final mean 2nh 512
    "hc": ("hc", [], 4 * (512 + 2048 + 512 + 512 + 3072) + 512),
    "hc_static": ("hc", ["model.hc.dynamic=false"], 4 * (512 + 2048 + 512) + 512),
    # 4 sublayers x (RMS over nh 512 + projection 2nh(n^2 + 2n) 12288 + read 512 + mix 2048
    # + write 512), then the final mean 512
    "mhc": ("mhc", [], 4 * (512 + 12288 + 512 + 2048 + 512) + 512),
    # the mixer, and an mHC connection on each of 6 sublayers
    "mhc+shortswa": (
        "mhc",
        ["model.shortswa.window=16"],
        SHORTSWA_16 + 6 * (512 + 12288 + 512 + 2048 + 512) + 512,
    ),
}


def _model(residual: str, *extra: str):
    return load_config(overrides=BASE + [f"model.residual={residual}", *extra]).model


def test_standard_model_flops_are_6n_plus_causal_attention():
    assert model_flops_per_token(_model("standard"), VOCAB) == STANDARD_TRAIN_FLOPS


@pytest.mark.parametrize("variant", EXTRA_FORWARD_FLOPS)
def test_each_design_adds_its_hand_counted_flops(variant):
    design, overrides, extra = EXTRA_FORWARD_FLOPS[variant]
    model = _model(design, *overrides)
    assert forward_flops_per_token(model, VOCAB) - plain_forward_flops_per_token(
        model, VOCAB
    ) == pytest.approx(extra)
    assert model_flops_per_token(model, VOCAB) == pytest.approx(STANDARD_TRAIN_FLOPS + 3 * extra)


def test_recompute_is_not_model_flops():
    assert (
        model_flops_per_token(_model("standard", "model.recompute=full"), VOCAB)
        == STANDARD_TRAIN_FLOPS
    )


def test_tflops_and_mfu_arithmetic():
    # 8 devices share 1M tokens/s of a model costing 6e9 FLOPs per token: 750 TFLOP/s each,
    # 75.8% of an H100 SXM's 989.4 bf16 TFLOP/s.
    achieved = tflops_per_device(1e6, 6e9, devices=8)
    assert achieved == pytest.approx(750.0)
    assert achieved / peak_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16) == pytest.approx(
        0.758, abs=1e-3
    )


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4),
        ("NVIDIA H100 80GB HBM3", torch.float32, 66.9),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
        ("NVIDIA H100 NVL", torch.bfloat16, 835.0),
        ("NVIDIA H200", torch.bfloat16, 989.4),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
        ("NVIDIA A100 80GB PCIe", torch.float16, 312.0),
        ("Tesla T4", torch.bfloat16, None),
    ],
)
def test_peak_table(name, dtype, peak):
    assert peak_tflops(name, dtype) == peak


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_mfu_is_not_applicable_on_cpu_unless_a_peak_is_configured():
    peak, note = resolve_peak(0.0, torch.float32)
    assert peak is None and "not applicable on CPU" in note
    assert resolve_peak(100.0, torch.float32)[0] == 100.0
