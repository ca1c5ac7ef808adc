"""The Triton kernels against the best available peers (run it with ``python -m
t2train.bench.kernels``, which takes the shapes from the presets).

Each design folder builds its kernels' cases at a preset's shapes and options
(``t2train/residual/<design>/benchmarks.py``; the registry's ``kernel_benchmarks()``); this
module times them. Per kernel, shape and mode (forward, forward+backward) it gives time,
achieved TFLOP/s or GB/s, and for the Triton row the speed ratio against the fastest peer of
the same run (> 1: faster). Peers: PyTorch eager, the same reference under
``torch.compile``, and the libraries a case adds where installed (FlexAttention, flash-attn,
``flash-attn-res``). Peers that are not installed or fail are reported and skipped.

FLOPs: attention forward 4 d (visited query-key pairs), backward 2.5x that. Bytes: the
tensors a fused pass must read and write once (each case's module says which).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional

import torch

from t2train.kernels.benchmark import Case, Impl, KernelShapes, Runtime
from t2train.residual import kernel_benchmarks

MODES = ("fwd", "fwd+bwd")


@dataclass
class Row:
    kernel: str
    preset: str
    shape: str
    mode: str
    impl: str
    ms: Optional[float]  # None: the implementation failed
    throughput: Optional[float]
    unit: str
    vs_best_peer: Optional[float] = None  # Triton rows: fastest peer's ms / Triton's ms
    error: str = ""


def _outputs(result) -> list:
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _cpu_bench(fn: Callable, grad_to_none: Optional[list] = None, reps: int = 3) -> float:
    """Median milliseconds of ``reps`` calls after one warm-up (the CPU dry run's timer)."""
    times = []
    for index in range(reps + 1):
        for t in grad_to_none or []:
            t.grad = None
        started = time.perf_counter()
        fn()
        if index:
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def bench_ms(rt: Runtime, fn: Callable, grad_to_none: Optional[list] = None) -> float:
    """Milliseconds per call of ``fn``: triton's do_bench on the GPU, a median on the CPU."""
    if not rt.on_cuda:
        return _cpu_bench(fn, grad_to_none)
    from triton.testing import do_bench

    return do_bench(fn, grad_to_none=grad_to_none)


def time_ms(rt: Runtime, impl: Impl, mode: str) -> float:
    if mode == "fwd":
        with torch.no_grad():
            return bench_ms(rt, impl.run)
    grads = [torch.randn_like(o) for o in _outputs(impl.run())]

    def step():
        torch.autograd.backward(_outputs(impl.run()), grads)

    return bench_ms(rt, step, impl.inputs)


def cases(shapes: KernelShapes, rt: Runtime, only=None) -> Iterator[Case]:
    """Every kernel's cases at one preset's shapes; tensors are made as each case starts."""
    benchmarks = kernel_benchmarks()
    for name in only or benchmarks:
        builder, _ = benchmarks[name]
        yield from builder(shapes, rt)


def copy_bandwidth_gbs() -> float:
    """What a plain device copy achieves: the yardstick for the memory-bound kernels."""
    from triton.testing import do_bench

    src = torch.empty(256 * 2**20, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / do_bench(lambda: dst.copy_(src)) / 1e6


def run_case(case: Case, rt: Runtime, modes=MODES) -> list[Row]:
    rows = []
    for mode in (mode for mode in modes if mode in case.work):  # a backward has one mode
        work, timed = case.work[mode], []
        for impl in case.impls:
            row = Row(case.kernel, case.preset, case.shape, mode, impl.name, None, None, case.unit)
            try:
                row.ms = time_ms(rt, impl, mode)
                row.throughput = work / row.ms / (1e9 if case.unit == "TFLOP/s" else 1e6)
            except Exception as err:  # a peer that cannot run this shape is reported, not fatal
                row.error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:120]}"
            timed.append(row)
        peers = [row.ms for row in timed if row.impl != "triton" and row.ms is not None]
        for row in timed:
            if row.impl == "triton" and row.ms is not None and peers:
                row.vs_best_peer = min(peers) / row.ms
        rows += timed
    return rows


TABLE_HEADER = ["kernel", "preset", "shape", "mode", "impl", "ms", "throughput", "vs best peer"]


def table_cells(row: Row) -> list[str]:
    if row.ms is None:
        return [
            row.kernel,
            row.preset,
            row.shape,
            row.mode,
            row.impl,
            f"failed: {row.error}",
            "",
            "",
        ]
    ratio = f"{row.vs_best_peer:.2f}x" if row.vs_best_peer is not None else ""
    return [
        row.kernel,
        row.preset,
        row.shape,
        row.mode,
        row.impl,
        f"{row.ms:.3f}",
        f"{row.throughput:.1f} {row.unit}",
        ratio,
    ]


def row_dict(row: Row) -> dict:
    return asdict(row)
