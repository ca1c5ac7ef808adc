"""Run megatron-core 0.16 on a CPU-only torch (gloo), without editing megatron-core.

megatron-core assumes CUDA in a few dozen places: ``torch.cuda.current_device()`` as an
allocation device, literal ``device="cuda"`` in factory calls, CUDA RNG state for its RNG
tracker, and ``torch.cuda.synchronize``. On a machine without CUDA we give each affected
megatron module its own ``torch`` that maps those to the CPU. Nothing outside megatron-core
sees a change, and nothing is patched when CUDA is available.

``apply()`` is idempotent. ``PATCHED_MODULES`` is the contract with megatron-core; the test
``tests/test_compat.py`` checks every entry still exists and still needs the patch, so an
upgrade that moves or fixes these places fails loudly instead of silently.
"""

from __future__ import annotations

import importlib
import types

import torch

from t2train.compat import library_noise

SUPPORTED_MEGATRON = ("0.16.",)

# megatron-core modules that allocate on, or query, the CUDA device at run time.
PATCHED_MODULES = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.rerun_state_machine",
    "megatron.core.timers",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.transformer.module",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)

_CPU = torch.device("cpu")
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "as_tensor")
_applied = False


def needed() -> bool:
    """The shim is for processes that cannot use CUDA at all."""
    return not torch.cuda.is_available()


def _to_cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return _CPU
    if torch.device(device).type == "cuda":
        return _CPU
    return device


def _remap_factory(fn):
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    factory.__name__ = fn.__name__
    return factory


def _cpu_cuda_namespace() -> types.SimpleNamespace:
    """What megatron calls on ``torch.cuda``, answered for the CPU.

    The RNG functions drive megatron's CUDA RNG tracker; on a CPU the device generator *is*
    the CPU generator, so forking the tracker forks ``torch``'s default generator.
    """
    ns = types.SimpleNamespace()
    for name in dir(torch.cuda):
        if not name.startswith("__"):
            setattr(ns, name, getattr(torch.cuda, name))
    ns.current_device = lambda: _CPU
    ns.synchronize = lambda *a, **k: None
    ns.is_available = lambda: False
    ns.get_rng_state = lambda *a, **k: torch.get_rng_state()
    ns.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    ns.manual_seed = lambda seed: torch.manual_seed(seed)
    ns.random = types.SimpleNamespace(
        get_rng_state=ns.get_rng_state, set_rng_state=ns.set_rng_state
    )
    ns.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None)
    return ns


def _cpu_torch() -> types.ModuleType:
    """A ``torch`` look-alike: everything is torch's, except CUDA device use maps to the CPU."""
    proxy = types.ModuleType("torch")
    setattr(proxy, "__getattr__", lambda name: getattr(torch, name))  # PEP 562: all else
    for name in _FACTORIES:
        setattr(proxy, name, _remap_factory(getattr(torch, name)))
    setattr(proxy, "cuda", _cpu_cuda_namespace())
    return proxy


def _set_cpu_rng_functions() -> None:
    random = importlib.import_module("megatron.core.tensor_parallel.random")

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    setattr(random, "_get_cuda_rng_state", get_state)
    setattr(random, "_set_cuda_rng_state", set_state)


def _cpu_tensor_semantics(fn):
    """Run ``fn`` with CPU tensors answering megatron's CUDA-only tensor calls.

    Inside the call, ``Tensor.type()`` reports CPU tensors under their CUDA names (the
    optimizers sort parameters by ``param.type() == 'torch.cuda.FloatTensor'``) and
    ``Tensor.cuda()`` keeps a tensor where it is. Scoped to the wrapped call so no other
    code sees either change.
    """

    def wrapped(*args, **kwargs):
        original_type, original_cuda = torch.Tensor.type, torch.Tensor.cuda

        def cuda_named_type(self, dtype=None, non_blocking=False, **kw):
            if dtype is None and self.device.type == "cpu":
                return original_type(self).replace("torch.", "torch.cuda.", 1)
            return original_type(self, dtype, non_blocking, **kw)

        setattr(torch.Tensor, "type", cuda_named_type)
        setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(torch.Tensor, "type", original_type)
            setattr(torch.Tensor, "cuda", original_cuda)

    setattr(wrapped, "__wrapped__", fn)
    return wrapped


def _patch_tensor_method_users() -> None:
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    clip = importlib.import_module("megatron.core.optimizer.clip_grads")
    language = importlib.import_module(
        "megatron.core.models.common.language_module.language_module"
    )
    for owner, name in (
        (distrib.DistributedOptimizer, "__init__"),
        (optimizer.Float16OptimizerWithFloat16Params, "__init__"),
        (language.LanguageModule, "setup_embeddings_and_output_layer"),
    ):
        setattr(owner, name, _cpu_tensor_semantics(getattr(owner, name)))
    for name in ("clip_grad_by_total_norm_fp32", "count_zeros_fp32"):
        checked = _cpu_tensor_semantics(getattr(clip, name))
        setattr(clip, name, checked)
        setattr(optimizer, name, checked)  # imported there by name


def apply(force: bool = False) -> bool:
    """Patch megatron-core for the CPU if CUDA is unavailable; returns whether it patched."""
    global _applied
    if _applied:
        return True
    if not (force or needed()):
        return False
    import megatron.core  # noqa: PLC0415 - megatron-core: only when the shim is applied

    version = megatron.core.__version__
    if not version.startswith(SUPPORTED_MEGATRON):
        raise RuntimeError(
            f"t2train's CPU shim supports megatron-core {SUPPORTED_MEGATRON}, found {version}; "
            "re-check t2train/compat/megatron_cpu.py against the new release"
        )
    proxy = _cpu_torch()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is not torch:
            raise RuntimeError(f"megatron-core module {name} no longer imports torch as 'torch'")
        setattr(module, "torch", proxy)
    _set_cpu_rng_functions()
    _patch_tensor_method_users()
    library_noise.silence_without_cuda()
    _applied = True
    return True
