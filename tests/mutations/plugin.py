"""pytest plugin: run the session with one named mutation applied to the source.

``T2_MUTATION=<name> python -m pytest -p tests.mutations.plugin ...`` installs an import hook
before anything imports ``t2train``: each module a mutation edits is compiled from its edited
source (the file on disk is never touched), and Triton's interpreter, which re-reads a
kernel's source through ``linecache``, sees the edited text too. At the end it writes to
``T2_MUTATION_REPORT`` (JSON) whether every edited module was loaded and the first failing
test, so the runner can tell "caught" from "never applied".
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import linecache
import os
import sys

from tests.mutations.catalog import by_name, module_of

_state = {"loaded": set(), "failed": None}


class _MutatedLoader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname: str, path: str, source: str):
        super().__init__(fullname, path)
        self.source = source

    def get_source(self, fullname):
        return self.source

    def get_code(self, fullname):  # never the cached bytecode of the unmutated file
        linecache.cache[self.path] = (
            len(self.source),
            None,
            self.source.splitlines(True),
            self.path,
        )
        _state["loaded"].add(fullname)
        return compile(self.source, self.path, "exec", dont_inherit=True)


class _MutatingFinder(importlib.abc.MetaPathFinder):
    def __init__(self, sources: dict[str, str]):
        self.sources = sources  # module name -> mutated source

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.sources:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                spec.loader = _MutatedLoader(fullname, spec.origin, self.sources[fullname])
                return spec
        return None


def _install() -> None:
    mutation = by_name(os.environ["T2_MUTATION"])
    sources = {module_of(path): text for path, text in mutation.mutated_sources().items()}
    imported = [name for name in sources if name in sys.modules]
    if imported:
        raise RuntimeError(f"{imported} imported before the mutation could apply")
    sys.meta_path.insert(0, _MutatingFinder(sources))
    _state["modules"] = sorted(sources)


if os.environ.get("T2_MUTATION"):
    _install()


def pytest_runtest_logreport(report):
    if report.failed and _state["failed"] is None:
        _state["failed"] = report.nodeid


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("T2_MUTATION_REPORT")
    if out:
        with open(out, "w") as f:
            json.dump(
                {
                    "applied": sorted(_state["loaded"]),
                    "expected": _state.get("modules", []),
                    "failed": _state["failed"],
                    "exitstatus": int(exitstatus),
                },
                f,
            )


def pytest_collectreport(report):
    if report.failed and _state["failed"] is None:
        _state["failed"] = f"collection of {report.nodeid}"
