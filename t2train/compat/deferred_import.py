"""Optional packages that megatron-core imports at module level but uses only in features
t2train does not run, loaded on first use instead.

megatron-core 0.16 does ``try: import wandb`` in its inference contexts, engines and timers,
so with ``t2train[wandb]`` installed every process that imports megatron.core (each rank of
every run, every command that reads a checkpoint) spent 2.8 s of its 10 s start-up loading
W&B (measured on the 2-core CPU machine). A stand-in module keeps ``import wandb`` true for
megatron's checks and imports the package when an attribute it lacks is first read
(``wandb.init`` in ``t2train/monitor/wandb_sink.py``). It carries ``__file__``, ``__spec__``
and ``__path__`` itself because ``inspect.getmodule`` reads ``__file__`` of every module in
``sys.modules`` (torch does, at import): ``importlib.util.LazyLoader`` loads on any attribute.
The same holds for mosaicml-streaming's ``__init__``, which imports its text, vision and
multimodal datasets (torchvision among them) where t2train uses ``streaming.base``.

megatron-core's ``jit_fuser`` is ``torch.compile``, applied as a decorator to its fusions
when ``megatron.core`` is imported: that imports Inductor (0.8 s of every start) for functions
compiled at their first call anyway. ``megatron.core.jit`` is therefore loaded with a
``jit_fuser`` that calls ``torch.compile`` at that first call instead.

mosaicml-streaming's ``StreamingDataLoader`` module imports transformers (0.9 s of every
rank's start) for two classes, ``BatchEncoding`` and ``BatchFeature``, that it only tests
batches against when it counts their samples. t2train's batches are dicts of tensors, so the
module is loaded with stand-in classes in their place (nothing is an instance of them), and
transformers loads when something else needs it (the Hugging Face export).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types

DEFERRED = ("wandb", "streaming.multimodal", "streaming.text", "streaming.vision")
MEGATRON_JIT = "megatron.core.jit"
STREAMING_LOADER = "streaming.base.dataloader"
# what STREAMING_LOADER imports from transformers: module -> class
STREAMING_LOADER_IMPORTS = {
    "transformers.feature_extraction_utils": "BatchFeature",
    "transformers.tokenization_utils_base": "BatchEncoding",
}
_LOCK = threading.Lock()
# Attributes that tools probe on every module they meet (inspect.unwrap, warnings): absent,
# not a reason to load the package.
_PROBES = frozenset({"__wrapped__", "__warningregistry__"})


class DeferredModule(types.ModuleType):
    """``sys.modules[name]`` until the package is needed; then a view of the real module."""

    def __init__(self, spec):
        super().__init__(spec.name)
        self.__spec__, self.__file__, self.__loader__ = spec, spec.origin, spec.loader
        if spec.submodule_search_locations is not None:
            self.__path__ = list(spec.submodule_search_locations)

    def __getattr__(self, attr: str):
        if attr in _PROBES:
            raise AttributeError(attr)
        return getattr(self.loaded(), attr)

    def loaded(self) -> types.ModuleType:
        with _LOCK:
            real = self.__dict__.get("_real")
            if real is None:
                if sys.modules.get(self.__name__) is self:
                    del sys.modules[self.__name__]
                real = self.__dict__["_real"] = importlib.import_module(self.__name__)
        return real


def _spec_unimported(name: str):
    """``name``'s spec, or None if not installed, without importing its parent package
    (``importlib.util.find_spec`` would run the parent's ``__init__``)."""
    parent, _, _ = name.rpartition(".")
    if not parent:
        return importlib.util.find_spec(name)
    parent_spec = _spec_unimported(parent)
    if parent_spec is None or parent_spec.submodule_search_locations is None:
        return None
    return importlib.machinery.PathFinder.find_spec(name, parent_spec.submodule_search_locations)


def compile_at_first_call(fn=None, **options):
    """``torch.compile`` as a decorator that imports and compiles at the first call (as
    ``torch.compile`` compiles then), inlined when the caller is itself being compiled."""
    if fn is None:
        return functools.partial(compile_at_first_call, **options)
    import torch  # noqa: PLC0415 - runs before torch is imported: at the first call

    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if torch.compiler.is_compiling():  # dynamo traces fn into the caller's graph
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return call


class _LoadedThrough(importlib.abc.MetaPathFinder):
    """Loads the module ``name`` from its file as usual, through ``load(run, module)``, where
    ``run(module)`` executes the file."""

    def __init__(self, name: str, load):
        self.name, self.load = name, load

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        loader = spec.loader
        assert loader is not None  # a module file's spec has the loader that runs it
        setattr(loader, "exec_module", functools.partial(self.load, loader.exec_module))
        return spec


def _jit_fuser_at_first_call(run, module) -> None:
    """``megatron.core.jit`` as it is, its ``jit_fuser`` swapped if it is ``torch.compile``
    (before any fusion module imports it)."""
    import torch  # noqa: PLC0415 - runs before torch is imported: at the first call

    run(module)
    if module.jit_fuser is torch.compile:
        module.jit_fuser = compile_at_first_call


def _without_transformers(run, module) -> None:
    """``streaming.base.dataloader`` with stand-ins for the transformers classes it imports,
    unless transformers is loaded already. The stand-in modules leave ``sys.modules`` once the
    file has run, so a later ``import transformers`` loads the real package."""
    if "transformers" in sys.modules:
        run(module)
        return
    stand_ins = {}
    for name, cls in STREAMING_LOADER_IMPORTS.items():
        stand_ins[name] = types.ModuleType(name)
        setattr(stand_ins[name], cls, type(cls, (), {"__module__": name}))
    sys.modules.update(stand_ins)
    try:
        run(module)
    finally:
        for name, stand_in in stand_ins.items():
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]


LOADED_THROUGH = {MEGATRON_JIT: _jit_fuser_at_first_call, STREAMING_LOADER: _without_transformers}


def defer() -> None:
    """Put a DeferredModule in ``sys.modules`` for each installed, not yet imported package of
    DEFERRED, and load the modules of LOADED_THROUGH through their patch (idempotent; call
    before megatron.core and streaming are imported)."""
    for name in DEFERRED:
        if name in sys.modules or name.partition(".")[0] in sys.modules:
            continue
        spec = _spec_unimported(name)
        if spec is not None:
            sys.modules[name] = DeferredModule(spec)
    installed = {f.name for f in sys.meta_path if isinstance(f, _LoadedThrough)}
    for name, load in LOADED_THROUGH.items():
        if name not in sys.modules and name not in installed:
            sys.meta_path.insert(0, _LoadedThrough(name, load))
