"""The megatron-core CPU shim: still needed, still applicable, and it makes training run.

If a megatron-core upgrade moves or fixes one of the patched places, these tests fail and
name it, so the shim is revisited instead of silently patching nothing.
"""

import importlib
import inspect
import subprocess
import sys

import megatron.core
import pytest
import torch

from t2train.compat import megatron_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is for CPU-only hosts")


def test_supported_version_is_installed():
    assert megatron.core.__version__.startswith(megatron_cpu.SUPPORTED_MEGATRON)


@pytest.mark.parametrize("name", megatron_cpu.PATCHED_MODULES)
def test_each_patched_module_still_uses_cuda(name):
    source = inspect.getsource(importlib.import_module(name))
    assert "cuda" in source, f"{name} no longer refers to CUDA: drop it from PATCHED_MODULES"


def test_megatron_without_the_shim_fails_on_cpu():
    script = (
        "import torch\n"
        "from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding\n"
        "RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)(16)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode != 0, "megatron-core now runs on CPU unpatched: shrink the shim"
    assert "NVIDIA" in proc.stderr or "CUDA" in proc.stderr


def test_shim_is_applied_by_distributed_init(megatron_world):
    assert megatron_cpu._applied
    rotary = importlib.import_module("megatron.core.models.common.embeddings.rotary_pos_embedding")
    assert rotary.torch is not torch and rotary.torch.cuda.current_device() == torch.device("cpu")
    assert rotary.torch.zeros(2, device="cuda").device.type == "cpu"


def test_unsupported_version_is_refused(monkeypatch):
    monkeypatch.setattr(megatron_cpu, "_applied", False)
    monkeypatch.setattr(megatron.core, "__version__", "9.9.0")
    with pytest.raises(RuntimeError, match="supports megatron-core"):
        megatron_cpu.apply(force=True)


def test_tensor_semantics_are_scoped():
    original_type, original_cuda = torch.Tensor.type, torch.Tensor.cuda

    @megatron_cpu._cpu_tensor_semantics
    def inside(t):
        return t.type(), t.cuda() is t

    assert inside(torch.zeros(1)) == ("torch.cuda.FloatTensor", True)
    assert torch.Tensor.type is original_type and torch.Tensor.cuda is original_cuda
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_the_optimizer_patch_names_what_moved(monkeypatch):
    """t2train/compat/megatron_optimizer.py replaces megatron-core's norm, clipping and copy
    (tests/test_host_syncs.py sees whether megatron-core still calls them); a name that is
    gone is an error naming the shim."""
    import importlib

    from t2train.compat import megatron_optimizer

    megatron_optimizer.apply()
    for module, name in megatron_optimizer.PATCHED:
        assert (
            getattr(importlib.import_module(module), name).__module__ == megatron_optimizer.__name__
        )
    monkeypatch.delattr(
        importlib.import_module(megatron_optimizer.MODULE), "clip_grad_by_total_norm_fp32"
    )
    with pytest.raises(
        RuntimeError,
        match="clip_grad_by_total_norm_fp32 is gone: update t2train/compat/megatron_optimizer.py",
    ):
        megatron_optimizer.apply()
