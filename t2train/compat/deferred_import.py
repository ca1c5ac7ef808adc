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
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types

DEFERRED = ("wandb",)
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


def defer() -> None:
    """Put a DeferredModule in ``sys.modules`` for each installed, not yet imported package of
    DEFERRED (idempotent; call before megatron.core is imported)."""
    for name in DEFERRED:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is not None:
            sys.modules[name] = DeferredModule(spec)
