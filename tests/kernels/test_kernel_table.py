"""The kernel table is the one list of kernels: every ``Kernel`` declared in the source is in
it, each kernel takes its reference's arguments, and the benchmark and the kernel tests cover
every entry (docs/kernels.md, "The kernel table")."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from t2train.residual import kernel_benchmarks, kernel_table

from kernel_checks import BACKWARD_NODES

REPO = Path(__file__).resolve().parents[2]


def _declared(paths) -> list[str]:
    """The names given to ``Kernel(...)`` in the source, one per declaration."""
    names = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Kernel"
            ):
                names.append(node.args[0].value)
    return names


def test_every_declared_kernel_is_in_the_table_once():
    paths = [p for folder in ("t2train", "kernels") for p in (REPO / folder).rglob("*.py")]
    declared = _declared(paths)
    assert sorted(declared) == sorted(kernel_table()), "add the Kernel to kernel_table()"
    assert all(kernel.name == name for name, kernel in kernel_table().items())


def test_each_kernel_takes_its_references_arguments():
    for name, kernel in kernel_table().items():
        ours = list(inspect.signature(kernel.triton_function()).parameters)
        theirs = list(inspect.signature(kernel.reference).parameters)
        assert ours == theirs, f"{name}: Triton {ours}, reference {theirs}"


def test_every_kernel_is_benchmarked_and_tested():
    benchmarked = {name for _, kernels in kernel_benchmarks().values() for name in kernels}
    assert benchmarked == set(kernel_table())
    assert set(BACKWARD_NODES) == set(kernel_table())


def test_the_scan_finds_a_declaration(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from t2train.kernels import dispatch\n\n"
        'A = dispatch.Kernel("a", "t2train.kernels.m:f", len)\n'
        'B = Kernel(\n    "b", "t2train.kernels.m:g", len)\n'
    )
    assert _declared([sample]) == ["a", "b"]
