"""T2_KERNELS picks the Triton kernels or the PyTorch references, and the dispatch says which
ran: every call routed to a kernel is counted under its name."""

import pytest
import torch

from t2train.kernels import dispatch
from t2train.nn.precision import fp32_linear
from t2train.residual.attnres.layers import mix_sources
from t2train.residual.ddl.layers import write_delta
from t2train.residual.window_attention import attend_window

from kernel_checks import BACKWARD_NODES, graph_nodes


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


def _call_each_kernel():
    """One call of each dispatched operator on small CPU tensors: name -> result."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, requires_grad=True)  # noqa: E731
    return {
        "window_attention": attend_window(r(1, 1, 4, 16), r(1, 1, 4, 16), r(1, 1, 4, 16), 2),
        "delta_write": write_delta(r(3, 1, 8), r(3, 1, 8), r(3, 1, 1), r(3, 1, 1), 1e-5, 4.0),
        "depth_mix": mix_sources(r(8), [r(1, 3, 1, 8)], r(3, 1, 8), 1e-6),
        "fp32_linear": fp32_linear(r(3, 1, 8), torch.nn.Linear(8, 2)),
    }


@pytest.mark.parametrize(
    "choice, runs_kernels", [("triton", True), ("torch", False), ("auto", False)]
)
def test_the_counter_says_which_ran(monkeypatch, choice, runs_kernels):
    """On CPU tensors only `triton` runs the kernels, forward and backward; the others run
    the references and count nothing."""
    monkeypatch.setenv("T2_KERNELS", choice)
    dispatch.reset_launches()
    results = _call_each_kernel()
    assert dict(dispatch.launches) == ({name: 1 for name in results} if runs_kernels else {})
    for name, out in results.items():
        assert bool(graph_nodes(out) & BACKWARD_NODES[name]) == runs_kernels, name
    dispatch.reset_launches()
    assert not dispatch.launches
