"""megatron-core 0.16.1's optimizer step without host syncs or per-tensor Python loops.

Without Apex and TransformerEngine (neither installs from a plain PyPI environment)
megatron-core falls back, in ``megatron.core.optimizer.optimizer``, to:

* ``get_grad_norm_fp32``: one ``torch.norm`` per gradient, gathered by ``torch.tensor(list)``
  (a device-to-host copy per gradient tensor on a GPU, ~74 per 125m step) and read back
  with ``.item()``, so the optimizer step waits for the device;
* ``clip_grad_by_total_norm_fp32``: a Python branch on that host value, then a loop of
  ``copy_(grad * scale)``;
* ``_multi_tensor_copy_this_to_that`` (main params to model params in bf16): a loop of
  ``copy_``.

Here the norm is ``torch._foreach_norm`` reduced on the device and returned as a 0-dim
tensor (read when it is logged), clipping multiplies every gradient by
``min(1, max_norm / (norm + 1e-6))`` on the device (``torch.nn.utils.clip_grad_norm_``'s
way: the factor is exactly 1 when there is nothing to clip), and copies are one
``torch._foreach_copy_``. The norm keeps megatron-core's reduction over
``grad_stats_parallel_group``; norms other than L2, and DTensor gradients, take
megatron-core's own function. ``PATCHED`` is the contract: ``tests/test_compat.py`` fails if
a name moves, ``tests/test_host_syncs.py`` if megatron-core stops calling it.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
import torch.distributed as dist

MODULE = "megatron.core.optimizer.optimizer"
PATCHED = (
    (MODULE, "get_grad_norm_fp32"),
    (MODULE, "clip_grad_by_total_norm_fp32"),
    (MODULE, "_multi_tensor_copy_this_to_that"),
)
_ORIGINAL: dict = {}


def grad_norm_on_device(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
    """The L2 norm of all ``grads_for_norm`` over ``grad_stats_parallel_group``, a 0-dim fp32
    tensor on their device."""
    grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else list(grads_for_norm)
    if float(norm_type) != 2.0 or any(_is_dtensor(g) for g in grads):
        return _ORIGINAL["get_grad_norm_fp32"](grads, norm_type, grad_stats_parallel_group)
    device = grads[0].device if grads else _default_device()
    squares = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        squares = torch.stack(torch._foreach_norm(grads)).float().square().sum()
    dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=grad_stats_parallel_group)
    return squares.sqrt()


def clip_on_device(parameters, max_norm: float, total_norm, use_decoupled_grad: bool = False):
    """Scale the gradients of ``parameters`` by ``min(1, max_norm / (total_norm + 1e-6))``."""
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [
        getattr(p, attribute).detach()
        for p in parameters
        if getattr(p, attribute, None) is not None
    ]
    if grads:
        factor = max_norm / (torch.as_tensor(total_norm, device=grads[0].device) + 1.0e-6)
        torch._foreach_mul_(grads, factor.clamp(max=1.0))


def copy_all(this: list, that: list, overflow_buf: Optional[torch.Tensor] = None) -> None:
    """``that[i].copy_(this[i])`` for all i, in one foreach call."""
    if this:
        torch._foreach_copy_(that, this)


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def apply() -> None:
    """Put the functions above in place of megatron-core's (idempotent)."""
    module = importlib.import_module(MODULE)
    replacements = {
        "get_grad_norm_fp32": grad_norm_on_device,
        "clip_grad_by_total_norm_fp32": clip_on_device,
        "_multi_tensor_copy_this_to_that": copy_all,
    }
    for _, name in PATCHED:
        current = getattr(module, name, None)
        if current is None:
            raise RuntimeError(
                f"{MODULE}.{name} is gone: update t2train/compat/"
                "megatron_optimizer.py for this megatron-core"
            )
        _ORIGINAL.setdefault(name, current)  # megatron-core's, from the first application
        setattr(module, name, replacements[name])
