"""A guard for the GPU between GPU runs: how often a training step waits for the device.

On a GPU every read of a device value by the host (``.item()``, ``float(t)``, ``bool(t)``,
``.tolist()``, an operator whose output size depends on the data) waits until the device has
run everything queued before it: time in which the host queues nothing. Counted here on the
CPU while the Megatron engine trains a tiny model, per optimizer step after a first one:

* operators that read a value back (``aten._local_scalar_dense``: item, float, int, bool)
  or whose output size depends on the data (``nonzero`` and friends), under a dispatch mode;
* ``Tensor.tolist`` and ``Tensor.numpy``, which on the CPU read memory without an operator.

The step reads the device once: the loss and whether every gradient is finite, which the
update guard needs before the update (``t2train/engine/megatron/step.py``). The gradient
norm and the pipeline traffic are read only when a step is logged. The budget is that one
read; before issue 43 the same step made 24 (and on a GPU one more per gradient tensor in
megatron-core's norm, which ``torch.tensor(list)`` hides from a dispatch mode:
``t2train/compat/megatron_optimizer.py``).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from t2train.config.loader import load_config

SYNCS_PER_STEP = 1
READING_OPERATORS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "equal",
}
TINY = [
    "data.path=unused",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.num_query_groups=1",
    "model.seq_length=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.warmup_steps=0",
    "train.lr=1e-2",
    "train.clip_grad=0.05",
]  # clipping: every step scales its gradients


class HostReads(TorchDispatchMode):
    """Counts the host's reads of tensor values while active."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.reads: Counter = Counter()
        for method in ("tolist", "numpy"):
            original = getattr(torch.Tensor, method)
            monkeypatch.setattr(torch.Tensor, method, self._counted(method, original))

    def _counted(self, name, original):
        def counted(tensor, *args, **kwargs):
            self.reads[name] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in READING_OPERATORS:
            self.reads[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _steps(megatron_world, overrides: list[str], steps: int, monkeypatch) -> Counter:
    """Host reads of ``steps`` training steps (after a first one, which builds state)."""
    from t2train.engine.megatron.numerics import UpdateGuard
    from t2train.engine.megatron.setup import build_training_objects
    from t2train.engine.megatron.step import train_step
    from t2train.parallel.init import set_seed

    set_seed(1234, megatron_world)
    config = load_config(overrides=TINY + overrides)
    objs = build_training_objects(config, 128)
    guard = UpdateGuard(config.train)
    g = torch.Generator().manual_seed(0)

    def micro_batches():
        tokens = [torch.randint(0, 128, (2, 17), generator=g) for _ in range(2)]
        return [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tokens]

    train_step(objs, micro_batches(), guard)
    with HostReads(monkeypatch) as counting:
        results = [train_step(objs, micro_batches(), guard) for _ in range(steps)]
    assert not any(result.skipped for result in results)
    return counting.reads


@pytest.mark.parametrize(
    "overrides",
    [[], ["train.precision=bf16"], ["parallel.distributed_optimizer=true"]],
    ids=["fp32", "bf16", "distributed-optimizer"],
)
def test_a_step_reads_the_device_once(megatron_world, monkeypatch, overrides):
    reads = _steps(megatron_world, overrides, 3, monkeypatch)
    assert sum(reads.values()) <= 3 * SYNCS_PER_STEP, dict(reads)


def test_the_count_sees_a_read_per_gradient(megatron_world, monkeypatch):
    """What the budget guards against: a clipping path that reads each gradient's norm back
    (as megatron-core's own does on a GPU) adds one read per gradient tensor and step."""
    from t2train.compat import megatron_optimizer

    clip = megatron_optimizer.clip_on_device

    def clip_reading_each_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
        [float(p.grad.norm()) for p in parameters if p.grad is not None]
        clip(parameters, max_norm, total_norm, use_decoupled_grad)

    monkeypatch.setattr(megatron_optimizer, "clip_on_device", clip_reading_each_norm)
    reads = _steps(megatron_world, [], 3, monkeypatch)
    assert sum(reads.values()) > 3 * SYNCS_PER_STEP + 3 * 10, dict(reads)


def test_the_norm_and_traffic_are_read_when_asked(megatron_world, monkeypatch):
    """A logged step's gradient norm (clipped here) and traffic are there when asked for:
    one read each, the norm the global L2 norm of the gradients before clipping."""
    from t2train.engine.megatron.setup import build_training_objects
    from t2train.engine.megatron.step import train_step
    from t2train.parallel.init import set_seed

    set_seed(1234, megatron_world)
    objs = build_training_objects(load_config(overrides=TINY), 128)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = [{"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}] * 2
    norms = []
    real_step = objs.optimizer.step

    def step_seeing_the_gradients():  # the norm written out, before Megatron clips
        grads = [
            p.main_grad if hasattr(p, "main_grad") else p.grad
            for chunk in objs.model
            for p in chunk.parameters()
        ]
        norms.append(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
        return real_step()

    objs.optimizer.step = step_seeing_the_gradients
    result = train_step(objs, batch)
    with HostReads(monkeypatch) as counting:
        grad_norm, traffic = result.grad_norm, result.traffic
    assert sum(counting.reads.values()) == 2, dict(counting.reads)
    assert grad_norm == pytest.approx(float(norms[0]), rel=1e-5)
    assert grad_norm > 0.05  # it was clipped
    assert set(traffic) >= {"pipeline/forward_hops", "pipeline/forward_wire_bytes"}
