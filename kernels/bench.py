"""``python -m t2train.kernels.bench``: the Triton kernels against the best available peers.

Per kernel, shape and mode (forward, forward+backward) it prints time, achieved TFLOP/s or
GB/s, and for the Triton row the speed ratio against the fastest peer of the same run
(> 1: faster). Peers: FlexAttention (sliding-window block mask) and flash-attn
(``window_size``) for window attention; eager and ``torch.compile`` references for the DDL
write and the mHC read and write; ``torch.compile`` and the ``flash-attn-res`` package for
Block AttnRes. Peers that are not installed or fail are reported and skipped. Without CUDA
it says so and exits 0.

FLOPs: attention forward 4 d (visited query-key pairs), backward 2.5x that. Bytes: the
tensors a fused pass must read and write once (DDL: state, k~, new state; backward: state,
k~, incoming and outgoing gradients; Block AttnRes: the N sources and S partial sums in, S
outputs out, and in the backward N + S inputs and S output gradients in, N + S gradients out;
mHC read: n streams in, one out, backward n + 1 in, n out; mHC write: n streams and the output
in, n out, backward 2n + 1 in, n + 1 out).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import sys
from dataclasses import dataclass
from typing import Callable

import torch

DTYPE = torch.bfloat16


@dataclass
class Impl:
    name: str
    run: Callable  # () -> tensor or list of tensors
    inputs: list  # leaves whose gradients the backward produces


@dataclass
class Case:
    kernel: str
    shape: str
    impls: list
    work: dict  # mode -> FLOPs or bytes
    unit: str  # "TFLOP/s" or "GB/s"


def _time_ms(impl: Impl, mode: str) -> float:
    from triton.testing import do_bench

    if mode == "fwd":
        with torch.no_grad():
            return do_bench(impl.run)
    outs = impl.run()
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    grads = [torch.randn_like(o) for o in outs]

    def step():
        result = impl.run()
        torch.autograd.backward(result if isinstance(result, (list, tuple)) else [result], grads)

    return do_bench(step, grad_to_none=impl.inputs)


def _leaf(*shape, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda", dtype=DTYPE) * scale).requires_grad_()


def window_cases():
    """Sequence ShortSWA shapes: 32k tokens, 16 heads of 128, windows 64/128/512."""
    from t2train.kernels.window_attention import window_attention

    heads, head_dim, tokens = 16, 128, 32768
    for seq in (4096, 16384):
        for window in (64, 128, 512):
            batch = tokens // seq
            q, k, v = (_leaf(batch, heads, seq, head_dim) for _ in range(3))
            impls = [Impl("triton", lambda q=q, k=k, v=v, w=window: window_attention(q, k, v, w),
                          [q, k, v])]
            impls += _flex_impls(batch, heads, seq, head_dim, window)
            impls += _flash_impls(batch, heads, seq, head_dim, window)
            pairs = sum(min(window, p + 1) for p in range(seq))
            flops = 4 * batch * heads * head_dim * pairs
            yield Case("window_attention", f"b={batch} h={heads} s={seq} d={head_dim} w={window}",
                       impls, {"fwd": flops, "fwd+bwd": 3.5 * flops}, "TFLOP/s")


def _flex_impls(batch, heads, seq, head_dim, window) -> list[Impl]:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return []

    def band(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    mask = create_block_mask(band, None, None, seq, seq, device="cuda")
    attend = torch.compile(flex_attention)
    q, k, v = (_leaf(batch, heads, seq, head_dim) for _ in range(3))
    return [Impl("flex_attention", lambda: attend(q, k, v, block_mask=mask), [q, k, v])]


def _flash_impls(batch, heads, seq, head_dim, window) -> list[Impl]:
    if importlib.util.find_spec("flash_attn") is None:
        return []
    from flash_attn import flash_attn_func

    q, k, v = (_leaf(batch, seq, heads, head_dim) for _ in range(3))
    return [Impl("flash_attn", lambda: flash_attn_func(q, k, v, causal=True,
                                                       window_size=(window - 1, 0)), [q, k, v])]


def ddl_cases():
    """The DDL write over 32k tokens of width 2048, d_v = 1 and 4."""
    from t2train.kernels.ddl_update import delta_write as fused
    from t2train.residual.ddl import delta_write

    tokens, hidden, k_eps, v_scale = (4096, 8), 2048, 1e-5, 4.0
    compiled = torch.compile(delta_write)
    for dv in (1, 4):
        state = _leaf(*tokens, hidden) if dv == 1 else _leaf(dv, *tokens, hidden)
        out, beta, v = _leaf(*tokens, hidden), _leaf(*tokens, 1), _leaf(*tokens, dv)
        inputs = [state, out, beta, v]
        impls = [Impl(name, lambda f=f, args=tuple(inputs): f(*args, k_eps, v_scale), inputs)
                 for name, f in (("triton", fused), ("eager", delta_write),
                                 ("torch.compile", compiled))]
        unit = state.element_size() * out.numel()
        yield Case("ddl_write", f"s={tokens[0]} b={tokens[1]} h={hidden} d_v={dv}", impls,
                   {"fwd": (2 * dv + 1) * unit, "fwd+bwd": (5 * dv + 3) * unit}, "GB/s")


def attnres_cases():
    """One block of S sublayer reads over N stored sources, 16k tokens of width 2048."""
    from t2train.kernels.block_attnres import phase_1, phase_2
    from t2train.residual.attnres import depth_mix

    n_src, n_q, batch, seq, hidden, eps = 5, 8, 1, 16384, 2048, 1e-6
    sources = _leaf(n_src, batch, seq, hidden)
    partials = [_leaf(batch, seq, hidden) for _ in range(n_q)]
    queries = _leaf(n_q, hidden, scale=hidden ** -0.5)
    inputs = [sources, queries, *partials]

    def two_phase(first, second):
        out, lse = first(queries, sources, eps)
        return [second(partials[i], queries[i], out[i], lse[i], eps) for i in range(n_q)]

    compiled = torch.compile(depth_mix)
    impls = [Impl("triton", lambda: two_phase(phase_1, phase_2), inputs),
             Impl("torch.compile",
                  lambda: [compiled(queries[i], [*sources.unbind(0), partials[i]], eps)
                           for i in range(n_q)], inputs)]
    if importlib.util.find_spec("flash_attn_res") is not None:
        import flash_attn_res as far

        impls.append(Impl("flash-attn-res", lambda: two_phase(
            far.phase_1_batched_attention_triton_op, far.phase_2_online_softmax_merge_triton_op),
            inputs))
    unit = sources[0].numel() * sources.element_size()
    yield Case("block_attnres", f"N={n_src} S={n_q} b={batch} t={seq} d={hidden}", impls,
               {"fwd": (n_src + 2 * n_q) * unit, "fwd+bwd": (3 * n_src + 5 * n_q) * unit},
               "GB/s")


def mhc_cases():
    """The mHC read and write (Sinkhorn, 20 iterations) over 32k tokens of width 2048, n = 4;
    the mixing logits are fp32, as the model computes them."""
    from t2train.kernels.mhc_streams import stream_read as fused_read
    from t2train.kernels.mhc_streams import stream_write as fused_write
    from t2train.residual.mhc import stream_read, stream_write

    n, tokens, hidden, iterations = 4, (4096, 8), 2048, 20
    state, out = _leaf(n, *tokens, hidden), _leaf(*tokens, hidden)
    pre, post, res = (torch.randn(*tokens, *shape, device="cuda").requires_grad_()
                      for shape in ((n,), (n,), (n, n)))
    unit = out.numel() * out.element_size()
    compiled_read, compiled_write = torch.compile(stream_read), torch.compile(stream_write)
    yield Case("mhc_read", f"s={tokens[0]} b={tokens[1]} h={hidden} n={n}",
               [Impl(name, lambda f=f: f(state, pre), [state, pre])
                for name, f in (("triton", fused_read), ("eager", stream_read),
                                ("torch.compile", compiled_read))],
               {"fwd": (n + 1) * unit, "fwd+bwd": (3 * n + 2) * unit}, "GB/s")
    inputs = [state, out, post, res]
    yield Case("mhc_write", f"s={tokens[0]} b={tokens[1]} h={hidden} n={n} t_max={iterations}",
               [Impl(name, lambda f=f: f(*inputs, iterations), inputs)
                for name, f in (("triton", fused_write), ("eager", stream_write),
                                ("torch.compile", compiled_write))],
               {"fwd": (2 * n + 1) * unit, "fwd+bwd": (5 * n + 3) * unit}, "GB/s")


def copy_bandwidth_gbs() -> float:
    """What a plain device copy achieves: the yardstick for the memory-bound kernels."""
    from triton.testing import do_bench

    src = torch.empty(256 * 2 ** 20, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / do_bench(lambda: dst.copy_(src)) / 1e6


def run_case(case: Case) -> list[str]:
    lines = []
    for mode, work in case.work.items():
        times = {}
        for impl in case.impls:
            try:
                times[impl.name] = _time_ms(impl, mode)
            except Exception as err:  # a peer that cannot run this shape is reported, not fatal
                lines.append(f"| {case.kernel} | {case.shape} | {mode} | {impl.name} | failed: "
                             f"{type(err).__name__}: {str(err).splitlines()[0][:80]} | | |")
        peers = [t for name, t in times.items() if name != "triton"]
        for name, ms in times.items():
            rate = work / ms / (1e9 if case.unit == "TFLOP/s" else 1e6)
            ratio = f"{min(peers) / ms:.2f}x" if name == "triton" and peers else ""
            lines.append(f"| {case.kernel} | {case.shape} | {mode} | {name} | {ms:.3f} | "
                         f"{rate:.1f} {case.unit} | {ratio} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["window", "ddl", "attnres", "mhc"], action="append",
                        help="benchmark only these kernels (repeatable)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("t2train.kernels.bench: no CUDA device, nothing to benchmark")
        return 0
    import triton

    torch.manual_seed(0)
    print(f"# Kernel benchmark: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, {datetime.date.today()}\n")
    print(f"Device copy bandwidth: {copy_bandwidth_gbs():.0f} GB/s\n")
    print("| kernel | shape | mode | impl | ms | throughput | vs best peer |")
    print("|---|---|---|---|---|---|---|")
    builders = {"window": window_cases, "ddl": ddl_cases, "attnres": attnres_cases,
                "mhc": mhc_cases}
    for name in args.only or builders:
        for case in builders[name]():
            for line in run_case(case):
                print(line, flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
