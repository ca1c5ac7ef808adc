"""Achieved TFLOP/s per device and model FLOPs utilisation (MFU).

    TFLOP/s per device = tokens/s (global) x model FLOPs per token / devices / 1e12
    MFU                = TFLOP/s per device / peak TFLOP/s of one device

Model FLOPs per token are forward + backward, 3x the forward count of
``t2train.model.flops`` (matmuls, causal attention, and the residual design's extra FLOPs).
Activation recompute is not counted (PaLM's definition of MFU), so a recomputing run shows
its extra work as lower MFU. Devices are all ranks: with tensor or pipeline parallelism each
holds part of the model, with data parallelism each processes part of the tokens.
"""

from __future__ import annotations

from typing import Optional

import torch

from t2train.config.schema import ModelConfig
from t2train.model.flops import forward_flops_per_token

# Dense (no structured sparsity) peak TFLOP/s of one GPU from NVIDIA's data sheets:
# (substring of torch.cuda.get_device_name(), bf16/fp16 tensor cores, plain fp32).
# Matched in order, so the more specific names come first.
PEAK_TFLOPS = (
    ("H200 NVL", 835.0, 60.0),
    ("H200", 989.4, 66.9),  # SXM
    ("H100 NVL", 835.0, 60.0),
    ("H100 PCIe", 756.0, 51.2),
    ("H100", 989.4, 66.9),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("A100", 312.0, 19.5),  # SXM4 and PCIe
)


def peak_tflops(device_name: str, dtype: torch.dtype) -> Optional[float]:
    """The table's peak for this GPU and compute dtype, or None for a GPU not listed."""
    for name, half, single in PEAK_TFLOPS:
        if name.lower() in device_name.lower():
            return single if dtype == torch.float32 else half
    return None


def model_flops_per_token(model: ModelConfig, vocab_size: int) -> float:
    """Forward + backward FLOPs of one token, without recomputation."""
    return 3 * forward_flops_per_token(model, vocab_size)


def tflops_per_device(tokens_per_sec: float, flops_per_token: float, devices: int) -> float:
    return tokens_per_sec * flops_per_token / devices / 1e12


def resolve_peak(configured_tflops: float, dtype: torch.dtype) -> tuple[Optional[float], str]:
    """The peak to divide by (None: no MFU) and a one-line note saying where it came from."""
    if configured_tflops > 0:
        return configured_tflops, f"MFU against log.peak_tflops={configured_tflops:g} TFLOP/s"
    if not torch.cuda.is_available():
        return None, "MFU: not applicable on CPU (no peak FLOP/s); logging achieved TFLOP/s"
    device = torch.cuda.get_device_name()
    peak = peak_tflops(device, dtype)
    if peak is None:
        return None, (
            f"MFU: no peak FLOP/s known for {device!r}; set log.peak_tflops to "
            "log MFU (achieved TFLOP/s is logged)"
        )
    precision = "fp32" if dtype == torch.float32 else "bf16"
    return peak, f"MFU against {device} peak {precision} {peak:g} TFLOP/s"
