"""The Triton kernels against the best available peers (run it with ``python -m
t2train.bench.kernels``, which takes the shapes from the presets).

Per kernel, shape and mode (forward, forward+backward) it gives time, achieved TFLOP/s or
GB/s, and for the Triton row the speed ratio against the fastest peer of the same run (> 1:
faster). Peers: PyTorch eager, the same reference under ``torch.compile``, FlexAttention
(sliding-window block mask) and flash-attn (``window_size``) for window attention, and
``flash-attn-res`` for Block AttnRes. Peers that are not installed or fail are reported and
skipped.

FLOPs: attention forward 4 d (visited query-key pairs), backward 2.5x that. Bytes: the
tensors a fused pass must read and write once (DDL: state, k~, new state; backward: state,
k~, incoming and outgoing gradients; Block AttnRes: the N sources and S partial sums in, S
outputs out, and in the backward N + S inputs and S output gradients in, N + S gradients out).
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional

import torch

from t2train.residual import kernel_table

MODES = ("fwd", "fwd+bwd")


@dataclass(frozen=True)
class Runtime:
    """Where and how the benchmark runs: CUDA in bf16, or a CPU dry run (Triton interpreter)."""

    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16

    @property
    def on_cuda(self) -> bool:
        return self.device == "cuda"

    def compile(self, fn: Callable) -> Callable:
        # On CPU, inductor would spend minutes in the C++ compiler; dynamo alone still runs.
        # Static shapes: the second shape of the same reference would otherwise recompile it
        # with dynamic shapes (dynamo's automatic dynamic), a slower peer than a user's.
        return (
            torch.compile(fn, dynamic=False) if self.on_cuda else torch.compile(fn, backend="eager")
        )


@dataclass(frozen=True)
class KernelShapes:
    """One micro-batch of a model's shapes, and the design options the kernels run at."""

    label: str
    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    window: int  # ShortSWA window
    depth_window: int  # depth_attn: the layer states a read attends over
    ddl_widths: tuple  # d_v values
    sources: int  # completed Block AttnRes sources at the last block
    block: int  # sublayers per Block AttnRes block (queries per phase-1 call)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass
class Impl:
    name: str
    run: Callable  # () -> tensor or list of tensors
    inputs: list  # leaves whose gradients the backward produces


@dataclass
class Case:
    kernel: str
    preset: str
    shape: str
    impls: list
    work: dict  # mode -> FLOPs or bytes
    unit: str  # "TFLOP/s" or "GB/s"


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


def _bench(rt: Runtime, fn: Callable, grad_to_none: Optional[list] = None) -> float:
    if not rt.on_cuda:
        return _cpu_bench(fn, grad_to_none)
    from triton.testing import do_bench

    return do_bench(fn, grad_to_none=grad_to_none)


def time_ms(rt: Runtime, impl: Impl, mode: str) -> float:
    if mode == "fwd":
        with torch.no_grad():
            return _bench(rt, impl.run)
    grads = [torch.randn_like(o) for o in _outputs(impl.run())]

    def step():
        torch.autograd.backward(_outputs(impl.run()), grads)

    return _bench(rt, step, impl.inputs)


def _leaf(rt: Runtime, *shape, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=rt.device, dtype=rt.dtype) * scale).requires_grad_()


def window_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    """Sequence ShortSWA: one micro-batch of the preset's heads, causal window."""
    kernel = kernel_table()["window_attention"]
    window_attention, short_window_attention = kernel.triton_function(), kernel.reference

    b, s, w, d = shapes.batch, shapes.seq, shapes.window, shapes.head_dim
    h, hk = shapes.heads, shapes.kv_heads
    q, k, v = _leaf(rt, b, h, s, d), _leaf(rt, b, hk, s, d), _leaf(rt, b, hk, s, d)
    compiled = rt.compile(short_window_attention)
    impls = [
        Impl("triton", lambda: window_attention(q, k, v, w), [q, k, v]),
        Impl("eager", lambda: short_window_attention(q, k, v, w), [q, k, v]),
        Impl("torch.compile", lambda: compiled(q, k, v, w), [q, k, v]),
    ]
    impls += _flex_impls(rt, q, k, v, w)
    impls += _flash_impls(rt, b, h, hk, s, d, w)
    pairs = sum(min(w, p + 1) for p in range(s))
    flops = 4 * b * h * d * pairs
    yield Case(
        "window_attention",
        shapes.label,
        f"b={b} h={h}/{hk} s={s} d={d} w={w}",
        impls,
        {"fwd": flops, "fwd+bwd": 3.5 * flops},
        "TFLOP/s",
    )


def depth_read_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    """depth_attn's read: one query per token and head over its last ``depth_window`` layer
    states (the model's heads, no grouping), against the FlashAttention-style kernel that
    served it before the one-query kernels (16 query rows per tile, 15 of them padding)."""
    from t2train.kernels.window_attention import tiled_window_attention

    kernel = kernel_table()["window_attention"]
    window_attention, short_window_attention = kernel.triton_function(), kernel.reference

    tokens, h, n, d = shapes.batch * shapes.seq, shapes.heads, shapes.depth_window, shapes.head_dim
    q, k, v = _leaf(rt, tokens, h, 1, d), _leaf(rt, tokens, h, n, d), _leaf(rt, tokens, h, n, d)
    scale = d**-0.5
    compiled = rt.compile(short_window_attention)
    impls = [
        Impl("triton", lambda: window_attention(q, k, v, n, scale), [q, k, v]),
        Impl(
            "triton, 16-query tiles", lambda: tiled_window_attention(q, k, v, n, scale), [q, k, v]
        ),
        Impl("eager", lambda: short_window_attention(q, k, v, n, scale), [q, k, v]),
        Impl("torch.compile", lambda: compiled(q, k, v, n, scale), [q, k, v]),
    ]
    unit = tokens * h * d * q.element_size()  # q or o; k and v are n of these each
    yield Case(
        "depth_read",
        shapes.label,
        f"tokens={tokens} h={h} n={n} d={d}",
        impls,
        {"fwd": (2 * n + 2) * unit, "fwd+bwd": (6 * n + 5) * unit},
        "GB/s",
    )


def _flex_impls(rt: Runtime, q, k, v, window) -> list[Impl]:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return []

    def band(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    seq = q.shape[-2]
    mask = create_block_mask(band, None, None, seq, seq, device=rt.device)
    # Eager FlexAttention is a slow reference; on CUDA it is only ever used compiled.
    attend = torch.compile(flex_attention) if rt.on_cuda else flex_attention
    gqa = q.shape[1] != k.shape[1]
    return [
        Impl("flex_attention", lambda: attend(q, k, v, block_mask=mask, enable_gqa=gqa), [q, k, v])
    ]


def _flash_impls(rt: Runtime, b, h, hk, s, d, window) -> list[Impl]:
    if not rt.on_cuda or importlib.util.find_spec("flash_attn") is None:
        return []
    from flash_attn import flash_attn_func

    q, k, v = _leaf(rt, b, s, h, d), _leaf(rt, b, s, hk, d), _leaf(rt, b, s, hk, d)
    return [
        Impl(
            "flash_attn",
            lambda: flash_attn_func(q, k, v, causal=True, window_size=(window - 1, 0)),
            [q, k, v],
        )
    ]


def delta_write_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    """The DDL write over one micro-batch of the preset's width, for each d_v."""
    kernel = kernel_table()["delta_write"]
    fused, delta_write = kernel.triton_function(), kernel.reference

    tokens, hidden, k_eps, v_scale = (shapes.seq, shapes.batch), shapes.hidden, 1e-5, 4.0
    compiled = rt.compile(delta_write)
    for dv in shapes.ddl_widths:
        state = _leaf(rt, *tokens, hidden) if dv == 1 else _leaf(rt, dv, *tokens, hidden)
        out, beta, v = _leaf(rt, *tokens, hidden), _leaf(rt, *tokens, 1), _leaf(rt, *tokens, dv)
        inputs = [state, out, beta, v]
        impls = [
            Impl(name, lambda f=f, args=tuple(inputs): f(*args, k_eps, v_scale), inputs)
            for name, f in (("triton", fused), ("eager", delta_write), ("torch.compile", compiled))
        ]
        unit = state.element_size() * out.numel()
        yield Case(
            "delta_write",
            shapes.label,
            f"s={tokens[0]} b={tokens[1]} h={hidden} d_v={dv}",
            impls,
            {"fwd": (2 * dv + 1) * unit, "fwd+bwd": (5 * dv + 3) * unit},
            "GB/s",
        )


def gate_logit_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    """DDL's gate logits in fp32 (beta: one output; v: d_v outputs) over one micro-batch of
    the preset's width."""
    kernel = kernel_table()["fp32_linear"]
    fused, linear_in_fp32 = kernel.triton_function(), kernel.reference

    tokens, hidden = (shapes.seq, shapes.batch), shapes.hidden
    x = _leaf(rt, *tokens, hidden)
    compiled = rt.compile(linear_in_fp32)
    for outputs in shapes.ddl_widths:
        weight, bias = _leaf(rt, outputs, hidden, scale=hidden**-0.5), _leaf(rt, outputs)
        inputs = [x, weight, bias]
        impls = [
            Impl(name, lambda f=f, args=tuple(inputs): f(*args), inputs)
            for name, f in (
                ("triton", fused),
                ("eager", linear_in_fp32),
                ("torch.compile", compiled),
            )
        ]
        unit = x.numel() * x.element_size()  # read x; the backward reads x, writes dx
        yield Case(
            "fp32_linear",
            shapes.label,
            f"s={tokens[0]} b={tokens[1]} h={hidden} outputs={outputs}",
            impls,
            {"fwd": unit, "fwd+bwd": 3 * unit},
            "GB/s",
        )
    yield from _rms_logit_cases(shapes, rt)


def _rms_logit_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    """HC's dynamic weights: n = 4 streams, each RMS-normalised on its own, n + 2 = 6 logits
    in fp32 (the norm's weight folded into the fp32 projection, as the model does)."""
    kernel = kernel_table()["rms_fp32_linear"]
    fused, reference = kernel.triton_function(), kernel.reference
    n, outputs, eps = 4, 6, 1e-5
    state = _leaf(rt, n, shapes.seq, shapes.batch, shapes.hidden)
    weight = (
        torch.randn(outputs, shapes.hidden, device=rt.device) * shapes.hidden**-0.5
    ).requires_grad_()
    inputs = [state, weight]
    compiled = rt.compile(reference)
    impls = [
        Impl(name, lambda f=f: f(state, weight, None, eps), inputs)
        for name, f in (("triton", fused), ("eager", reference), ("torch.compile", compiled))
    ]
    unit = state.numel() * state.element_size()  # read x; the backward reads x, writes dx
    yield Case(
        "rms_fp32_linear",
        shapes.label,
        f"n={n} s={shapes.seq} b={shapes.batch} h={shapes.hidden} outputs={outputs}",
        impls,
        {"fwd": unit, "fwd+bwd": 3 * unit},
        "GB/s",
    )


def depth_mix_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    """Block AttnRes: one block's S sublayer reads over the N completed sources of the
    preset's last block: the two phases' kernels against one reference read per sublayer."""
    table = kernel_table()
    phase_1, phase_2 = (
        table[name].triton_function() for name in ("block_phase_1", "block_phase_2")
    )
    depth_mix = table["depth_mix"].reference

    n_src, n_q, eps = shapes.sources, shapes.block, 1e-6
    batch, seq, hidden = shapes.batch, shapes.seq, shapes.hidden
    sources = _leaf(rt, n_src, batch, seq, hidden)
    partials = [_leaf(rt, batch, seq, hidden) for _ in range(n_q)]
    queries = _leaf(rt, n_q, hidden, scale=hidden**-0.5)
    inputs = [sources, queries, *partials]

    def two_phase(first, second):
        out, lse = first(queries, sources, eps)
        return [second(partials[i], queries[i], out[i], lse[i], eps) for i in range(n_q)]

    def per_read(mix):
        return [mix(queries[i], list(sources.unbind(0)), partials[i], eps) for i in range(n_q)]

    compiled = rt.compile(depth_mix)
    impls = [
        Impl("triton", lambda: two_phase(phase_1, phase_2), inputs),
        Impl("eager", lambda: per_read(depth_mix), inputs),
        Impl("torch.compile", lambda: per_read(compiled), inputs),
    ]
    if rt.on_cuda and importlib.util.find_spec("flash_attn_res") is not None:
        import flash_attn_res as far

        impls.append(
            Impl(
                "flash-attn-res",
                lambda: two_phase(
                    far.phase_1_batched_attention_triton_op,
                    far.phase_2_online_softmax_merge_triton_op,
                ),
                inputs,
            )
        )
    unit = sources[0].numel() * sources.element_size()
    yield Case(
        "depth_mix",
        shapes.label,
        f"N={n_src} S={n_q} b={batch} t={seq} d={hidden}",
        impls,
        {"fwd": (n_src + 2 * n_q) * unit, "fwd+bwd": (3 * n_src + 5 * n_q) * unit},
        "GB/s",
    )


def stream_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    """mHC: the stream read and write (Sinkhorn, 20 iterations, n = 4 streams: the paper's
    defaults) over one micro-batch of the preset's width; the mixing logits are fp32, as the
    model computes them."""
    table = kernel_table()
    fused_read, stream_read = table["stream_read"].triton_function(), table["stream_read"].reference
    fused_write, stream_write = (
        table["stream_write"].triton_function(),
        table["stream_write"].reference,
    )
    n, iterations = 4, 20
    tokens, hidden = (shapes.seq, shapes.batch), shapes.hidden
    state, out = _leaf(rt, n, *tokens, hidden), _leaf(rt, *tokens, hidden)
    pre, post, res = (
        torch.randn(*tokens, *shape, device=rt.device).requires_grad_()
        for shape in ((n,), (n,), (n, n))
    )
    unit = out.numel() * out.element_size()
    read = [state, pre]
    yield Case(
        "stream_read",
        shapes.label,
        f"s={tokens[0]} b={tokens[1]} h={hidden} n={n}",
        [
            Impl(name, lambda f=f: f(*read), read)
            for name, f in (
                ("triton", fused_read),
                ("eager", stream_read),
                ("torch.compile", rt.compile(stream_read)),
            )
        ],
        {"fwd": (n + 1) * unit, "fwd+bwd": (3 * n + 2) * unit},
        "GB/s",
    )
    write = [state, out, post, res]
    yield Case(
        "stream_write",
        shapes.label,
        f"s={tokens[0]} b={tokens[1]} h={hidden} n={n} iterations={iterations}",
        [
            Impl(name, lambda f=f: f(*write, iterations), write)
            for name, f in (
                ("triton", fused_write),
                ("eager", stream_write),
                ("torch.compile", rt.compile(stream_write)),
            )
        ],
        {"fwd": (2 * n + 1) * unit, "fwd+bwd": (5 * n + 3) * unit},
        "GB/s",
    )
    yield from _hc_stream_cases(shapes, rt, state, out, pre, res, post, unit)


def _hc_stream_cases(shapes, rt, state, out, read, residual, beta, unit) -> Iterator[Case]:
    """HC's read and write: the same kernels with the weights as given (fp32, as the model
    computes them), against HC's own references."""
    table = kernel_table()
    fused_read, hc_read = table["hc_read"].triton_function(), table["hc_read"].reference
    fused_write, hc_write = table["hc_write"].triton_function(), table["hc_write"].reference
    n, (_, s, b, hidden) = state.shape[0], state.shape
    shape = f"s={s} b={b} h={hidden} n={n}"
    yield Case(
        "hc_read",
        shapes.label,
        shape,
        [
            Impl(name, lambda f=f: f(state, read), [state, read])
            for name, f in (
                ("triton", fused_read),
                ("eager", hc_read),
                ("torch.compile", rt.compile(hc_read)),
            )
        ],
        {"fwd": (n + 1) * unit, "fwd+bwd": (3 * n + 2) * unit},
        "GB/s",
    )
    write = [state, residual, beta, out]
    yield Case(
        "hc_write",
        shapes.label,
        shape,
        [
            Impl(name, lambda f=f: f(*write), write)
            for name, f in (
                ("triton", fused_write),
                ("eager", hc_write),
                ("torch.compile", rt.compile(hc_write)),
            )
        ],
        {"fwd": (2 * n + 1) * unit, "fwd+bwd": (5 * n + 3) * unit},
        "GB/s",
    )


# benchmark (``--only``) -> its cases, and the kernels of the table they time (every one is)
BUILDERS = {
    "window_attention": (window_cases, ("window_attention",)),
    "depth_read": (depth_read_cases, ("window_attention",)),
    "delta_write": (delta_write_cases, ("delta_write",)),
    "fp32_linear": (gate_logit_cases, ("fp32_linear", "rms_fp32_linear")),
    "depth_mix": (depth_mix_cases, ("block_phase_1", "block_phase_2", "depth_mix")),
    "stream_mix": (stream_cases, ("stream_read", "stream_write", "hc_read", "hc_write")),
}


def cases(shapes: KernelShapes, rt: Runtime, only=None) -> Iterator[Case]:
    """Every kernel's cases at one preset's shapes; tensors are made as each case starts."""
    for name in only or BUILDERS:
        builder, _ = BUILDERS[name]
        yield from builder(shapes, rt)


def copy_bandwidth_gbs() -> float:
    """What a plain device copy achieves: the yardstick for the memory-bound kernels."""
    from triton.testing import do_bench

    src = torch.empty(256 * 2**20, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / do_bench(lambda: dst.copy_(src)) / 1e6


def run_case(case: Case, rt: Runtime, modes=MODES) -> list[Row]:
    rows = []
    for mode in modes:
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
