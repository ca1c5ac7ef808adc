"""GPU check, environment: the device, the software versions, and measured peaks.

The bf16 n^3 matmul gives the compute peak this card reaches (MFU is reported against it as
well as against the data sheet); a device-to-device copy gives the bandwidth yardstick of the
memory-bound kernels.
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import time

PACKAGES = (
    "torch",
    "triton",
    "megatron-core",
    "mosaicml-streaming",
    "numpy",
    "transformers",
    "tokenizers",
    "tensorboard",
    "flash-attn",
    "deepspeed",
    "t2train",
)


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _driver() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unknown ({type(err).__name__})"


def device_facts() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"device": f"CPU ({platform.processor() or platform.machine()}), no CUDA"}
    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "driver": _driver(),
        "cuda": torch.version.cuda,
        "capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
    }


def matmul_tflops(n: int, repeats: int = 10) -> float:
    """bf16 n x n x n products on random data: the mean of ``repeats`` after 3 warm-ups."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - started) / 1e12


def run(section, plan) -> None:
    import torch

    from t2train.monitor.mfu import peak_tflops

    data = section.data
    data["versions"] = versions()
    data.update(device_facts())
    data["datasheet_bf16_tflops"] = (
        peak_tflops(data["device"], torch.bfloat16) if torch.cuda.is_available() else None
    )
    section.save()
    data["matmul"] = {"n": plan.matmul_size, "tflops": matmul_tflops(plan.matmul_size)}
    section.save()
    if torch.cuda.is_available():
        from t2train.bench.kernel_cases import copy_bandwidth_gbs

        data["copy_gbs"] = copy_bandwidth_gbs()
