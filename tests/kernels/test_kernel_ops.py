"""Every kernel is a well-formed custom operator (``torch.ops.t2train.*``): ``opcheck`` on the
arguments the kernels really receive, forward and backward operators alike.

``opcheck`` checks the schema (no input mutated or aliased), that the fake implementation
gives the real outputs' shapes, strides and dtypes (also with dynamic shapes, as dynamo
traces after a recompile), that the autograd registration is the one that runs, and that
AOTAutograd's traced forward and backward give the eager results.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from t2train.bench.kernel_cases import cases
from t2train.config.loader import load_config
from t2train.kernels import ops
from t2train.kernels.benchmark import KernelShapes, Runtime
from t2train.residual import kernel_table

for _kernel in kernel_table().values():  # registers every operator, before they are listed
    _kernel.triton_function()
SHAPES = KernelShapes(
    label="tiny",
    batch=1,
    model=load_config(
        "tiny",
        overrides=[
            "data.path=unused",
            "model.num_layers=3",
            "model.seq_length=8",
            "model.hidden_size=32",
            "model.num_attention_heads=2",
            "model.num_query_groups=1",
            "model.shortswa.window=4",
            "model.depth_attn.window=3",
            "model.attnres.block_size=3",
            "model.hc.expansion_rate=3",
        ],
    ).model,
)


class _Calls(TorchDispatchMode):
    """The first call of each kernel operator, with leaf copies of its arguments."""

    def __init__(self):
        super().__init__()
        self.calls: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == ops.NAMESPACE and func not in self.calls:
            # a backward operator runs without autograd (no double backward)
            differentiable = not func.overloadpacket.__name__.endswith("_backward")
            self.calls[func] = (
                torch.utils._pytree.tree_map_only(
                    torch.Tensor, lambda t: _leaf(t, differentiable), args
                ),
                kwargs or {},
            )
        return func(*args, **(kwargs or {}))


def _leaf(t: torch.Tensor, differentiable: bool) -> torch.Tensor:
    """A copy in the same layout (the operators' fakes must match strided inputs too)."""
    copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t)
    return copy.requires_grad_(differentiable and t.is_floating_point())


@pytest.fixture(scope="module")
def kernel_calls(monkeypatch_module) -> dict:
    """Each operator's first call while every benchmark case runs its Triton forward and
    backward at tiny shapes."""
    monkeypatch_module.setenv("T2_KERNELS", "triton")
    torch.manual_seed(0)
    recorder = _Calls()
    for case in cases(SHAPES, Runtime("cpu", torch.float32)):
        [triton] = [impl for impl in case.impls if impl.name == "triton"]
        with recorder:
            outputs = triton.run()
            outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            outputs = [o for o in outputs if o.requires_grad]  # none: the case is a backward
            torch.autograd.backward(outputs, [torch.randn_like(o) for o in outputs])
    return recorder.calls


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_every_operator_is_called(kernel_calls):
    registered = {name for name in ops.IMPLEMENTATIONS}
    called = {func.overloadpacket.__name__ for func in kernel_calls}
    assert called == registered


@pytest.mark.parametrize("name", sorted(ops.IMPLEMENTATIONS))
def test_opcheck(kernel_calls, name):
    [(func, (args, kwargs))] = [
        (f, call) for f, call in kernel_calls.items() if f.overloadpacket.__name__ == name
    ]
    results = torch.library.opcheck(func, args, kwargs)
    assert set(results.values()) == {"SUCCESS"}, results


# the mixer's window attention: a sublayer body (as flash attention, its backward is three
# kernels), which the byte account replaces by a GEMM
SEVERAL_KERNELS = {"window_attention_backward"}


@pytest.mark.parametrize("name", sorted(set(ops.IMPLEMENTATIONS) - SEVERAL_KERNELS))
def test_each_operator_launches_one_kernel(kernel_calls, name):
    """One launch, so its inputs are read once and its outputs written once: what the byte
    account counts for an operator, which it sees from outside (``t2train bench bytes``)."""
    from unittest import mock

    from triton.runtime.interpreter import GridExecutor

    [(args, kwargs)] = [
        call for f, call in kernel_calls.items() if f.overloadpacket.__name__ == name
    ]
    launch, launches = GridExecutor.__call__, []

    def counted(self, *a, **k):
        launches.append(self.fn.__name__ if hasattr(self.fn, "__name__") else self.fn)
        return launch(self, *a, **k)

    with mock.patch.object(GridExecutor, "__call__", counted), torch.no_grad():
        ops.IMPLEMENTATIONS[name](*args, **kwargs)
    assert len(launches) == 1, launches
