"""T2_KERNELS picks the Triton kernels or the PyTorch references."""

import pytest
import torch

from t2train.kernels import dispatch


def test_default_is_the_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("T2_KERNELS", raising=False)
    assert not dispatch.use_triton(torch.zeros(1))


def test_forcing(monkeypatch):
    monkeypatch.setenv("T2_KERNELS", "torch")
    assert not dispatch.use_triton(torch.zeros(1))
    monkeypatch.setenv("T2_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.use_triton(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.use_triton(torch.zeros(1))
    monkeypatch.setenv("T2_KERNELS", "cuda")
    with pytest.raises(ValueError, match="T2_KERNELS"):
        dispatch.use_triton(torch.zeros(1))
