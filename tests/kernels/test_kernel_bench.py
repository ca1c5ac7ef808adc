"""The benchmark runs anywhere: without CUDA it says so and succeeds."""

import torch

from t2train.bench import kernels


def test_without_cuda_it_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernels.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
