"""A guard on the hot path between GPU runs: how many operators one `standard` layer runs.

On the GPU every operator of the eager path is at least one kernel launch, and the 125m
profile (issue 31) had about 33 ms of a 220 ms step with no kernel running and 85 ms in
elementwise kernels and copies. A change that adds operators to every layer (a stray
``.contiguous()``, a ``cat``, a cast) costs that on every layer and micro-batch, and no CPU
test would otherwise notice. The budgets are today's counts: lower them when a change
removes operators; raise one only with the reason in the commit.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from t2train.config.loader import load_config

# Operators dispatched by one bf16 layer's forward + backward from no gradients, views
# excluded (they launch nothing): 12 matmuls, the RoPE of q and k (Megatron recomputes cos
# and sin and rotates with cat + neg: 8 cats), two RMSNorms (their statistics in fp32: 14
# casts), SwiGLU, SDPA, the residual adds, and their backward. (In fp32 it was 101.)
EAGER_OPS = 115
# Kernels Inductor generates for the compiled bf16 layer (forward + backward), besides the
# 12 matmuls and the two attention calls it leaves to the libraries, with Inductor's caches
# off (a cache hit generates nothing: the count would depend on earlier runs). On this CPU
# they are C++ loops (Triton kernels on a GPU fuse the same graph differently, so this
# guards against growth, it does not predict the GPU's count).
COMPILED_KERNELS = 39


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket is not torch.ops.aten._unsafe_view:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _layer_and_inputs(megatron_world):
    """A one-layer `standard` model in bf16, as on the GPU: in fp32 a stray ``.float()`` is
    free, and so invisible."""
    from t2train.model.build import build_model_chunks, transformer_config
    from t2train.parallel.init import set_seed

    set_seed(1234, megatron_world)
    config = load_config(
        overrides=[
            "data.path=unused",
            "model.num_layers=1",
            "model.hidden_size=32",
            "model.num_attention_heads=2",
            "model.num_query_groups=1",
            "model.seq_length=16",
            "model.fusions=none",
            "train.precision=bf16",
        ]
    )
    [model] = build_model_chunks(config, transformer_config(config), vocab_size=128)
    hidden = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0))
    return (
        model.decoder.layers[0],
        hidden.to(torch.bfloat16).requires_grad_(),
        model.rotary_pos_emb(16),
    )


def _forward_backward(layer, hidden, rotary):
    """From no gradients, as after ``zero_grad``: each gradient is written, not added to."""
    layer.zero_grad(set_to_none=True)
    hidden.grad = None
    out = layer(hidden, None, rotary)
    out.backward(torch.ones_like(out))
    return out


def _count(layer, hidden, rotary) -> Counter:
    with _CountOps() as counting:
        _forward_backward(layer, hidden, rotary)
    return counting.ops


def test_a_standard_layer_runs_within_its_operator_budget(megatron_world):
    ops = _count(*_layer_and_inputs(megatron_world))
    assert sum(ops.values()) <= EAGER_OPS, (
        f"{sum(ops.values())} operators per layer forward + backward, budget {EAGER_OPS}: "
        f"{dict(ops.most_common())}"
    )


def test_the_count_sees_one_extra_operator(megatron_world, monkeypatch):
    """What the budget guards against: one gratuitous copy in the layer's forward is one
    more operator (its backward passes the gradient through)."""
    from t2train.residual.standard.layers import AdditiveResidual

    layer, hidden, rotary = _layer_and_inputs(megatron_world)
    before = sum(_count(layer, hidden, rotary).values())
    write = AdditiveResidual.write
    monkeypatch.setattr(
        AdditiveResidual,
        "write",
        lambda self, state, x, normed, out: write(self, state, x, normed, out.clone()),
    )
    assert sum(_count(layer, hidden, rotary).values()) == before + 2  # two sublayers


def test_the_budget_sees_an_fp32_round_trip(megatron_world, monkeypatch):
    """A residual write that goes through fp32 and back, free in an fp32 model, costs six
    casts per sublayer in bf16 (three forward, three backward) and breaks the budget."""
    from t2train.residual.standard.layers import AdditiveResidual

    monkeypatch.setattr(
        AdditiveResidual,
        "write",
        lambda self, state, x, normed, out: (state.float() + out.float()).to(state.dtype),
    )
    ops = _count(*_layer_and_inputs(megatron_world))
    assert sum(ops.values()) == EAGER_OPS + 12 > EAGER_OPS


# Caches off, so that every kernel is generated here and counted; torch says that this also
# turns off its profile-guided recompilation, which this one compile does not use.
@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled:UserWarning")
def test_the_compiled_layer_generates_its_kernel_budget(megatron_world):
    """The fused path's layer through Inductor: the same output and gradients as eager, in
    at most ``COMPILED_KERNELS`` generated kernels."""
    from torch._inductor import metrics

    from t2train.nn.compiling import compile_modules

    layer, hidden, rotary = _layer_and_inputs(megatron_world)
    eager = _forward_backward(layer, hidden, rotary)
    grads = [hidden.grad] + [p.grad for p in layer.parameters()]
    torch._dynamo.reset()
    metrics.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        compile_modules([layer], backend="inductor")
        fused = _forward_backward(layer, hidden, rotary)
    assert 0 < metrics.generated_kernel_count <= COMPILED_KERNELS, metrics.generated_kernel_count
    # bf16: Inductor keeps fused intermediates in fp32, so results differ by bf16 roundings
    torch.testing.assert_close(fused, eager, rtol=2e-2, atol=2e-2)
    for ours, theirs in zip([hidden.grad] + [p.grad for p in layer.parameters()], grads):
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2 * theirs.abs().max())
