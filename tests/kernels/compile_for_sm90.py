"""Compile every Triton kernel for an H100 (sm_90) as the wrappers launch it, on a machine
without a GPU: ``python tests/kernels/compile_for_sm90.py`` (without TRITON_INTERPRET).

The interpreter runs the kernels' arithmetic but not Triton's compiler, which is stricter
(types, shapes of ``tl.dot``, loop bounds); a kernel that does not compile would fail its
first GPU run, in the middle of a scarce GPU session. Here each wrapper runs forward and
backward on small CPU tensors with ``JITFunction.run`` replaced: every launch is compiled to
a cubin for sm_90 with the launch's own argument types, constants and warp count (the GPU
tile sizes, since the interpreter is off) and the JIT's specialisation of its arguments
(alignment, divisibility by 16), and not run. Prints one line per compiled
specialisation, with its count of 16-byte (vectorised) global loads in the PTX; exits 1 with
the compiler's error on the first failure.
"""

from __future__ import annotations

import os
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
compiled: set = set()


def compile_launch(self: JITFunction, *args, grid, warmup, **kwargs):
    """In place of ``JITFunction.run``: compile this launch for sm_90, run nothing.

    The arguments are specialised by the JIT's own binder, as on a GPU: pointers aligned to
    16 bytes and integers divisible by 16 (or equal to 1) become attributes of the compiled
    kernel, which decide vectorised loads and the code path the GPU will compile.
    """
    binder = create_function_from_signature(self.signature, self.params, BACKEND)
    bound, specialization, options = binder(*args, **kwargs)
    key = (self.__name__, self.fn.__module__, str(specialization), str(options))
    if key not in compiled:
        options, signature, constexprs, attrs = self._pack_args(
            BACKEND, kwargs, bound, specialization, options
        )
        kernel = triton.compile(
            ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__
        )
        compiled.add(key)
        named = {self.params[path[0]].name: value for path, value in constexprs.items()}
        vector_loads = len(re.findall(r"ld\.global[.\w]*\.v4", kernel.asm["ptx"]))
        print(
            f"sm_90: {self.fn.__module__}.{self.__name__} {named} "
            f"num_warps={options.num_warps} aligned/divisible: {len(attrs)} "
            f"16-byte loads: {vector_loads}",
            flush=True,
        )


def _leaves(dtype, *shapes):
    return [torch.randn(*shape, dtype=dtype).requires_grad_() for shape in shapes]


def _backward(out) -> None:
    outs = torch.utils._pytree.tree_leaves(out)  # phase 1 gives its S outputs as a tuple
    torch.autograd.backward(
        [o for o in outs if o.requires_grad], [torch.ones_like(o) for o in outs if o.requires_grad]
    )


def launch_every_kernel(dtype) -> None:
    """Each wrapper forward and backward at shapes like the presets' (head dims 64 and 128,
    grouped heads, one query, d_v 1 and 4, a few sources and gate outputs)."""
    from t2train.kernels import ddl_update, depth_mix, fp32_linear, stream_mix
    from t2train.kernels.window_attention import window_attention

    for heads, kv_heads, q_len, k_len, head_dim, window in [
        (4, 4, 64, 64, 64, 16),
        (4, 2, 64, 64, 128, 16),
        (4, 4, 1, 4, 64, 4),
        (4, 2, 1, 4, 128, 2),
        (4, 4, 1, 1, 64, 4),
    ]:  # a first layer's read: one key
        q, k, v = _leaves(
            dtype,
            (2, heads, q_len, head_dim),
            (2, kv_heads, k_len, head_dim),
            (2, kv_heads, k_len, head_dim),
        )
        _backward(window_attention(q, k, v, window))
    for dv in (1, 4):
        state = _leaves(dtype, (8, 2, 256) if dv == 1 else (dv, 8, 2, 256))[0]
        out, beta, v_logit = _leaves(dtype, (8, 2, 256), (8, 2, 1), (8, 2, dv))
        _backward(ddl_update.delta_write(state, out, beta, v_logit, 1e-5, 4.0))
    for outputs in (1, 4, 6):
        x, weight, bias = _leaves(dtype, (8, 2, 256), (outputs, 256), (outputs,))
        _backward(fp32_linear.fp32_linear(x, weight, bias))
    query, partial, *sources = _leaves(dtype, (256,), (8, 2, 256), *[(8, 2, 256)] * 3)
    stacks = [torch.stack(sources[:2]), sources[2].unsqueeze(0)]
    _backward(depth_mix.depth_mix(query, stacks, partial, 1e-6))
    queries = _leaves(dtype, (4, 256))[0]
    _backward(depth_mix.phase_1(queries, stacks, 1e-6))
    _backward(depth_mix.phase_1_handing_on(queries, stacks[0], sources[2:], 1e-6))
    state, out = _leaves(dtype, (4, 8, 2, 256), (8, 2, 256))
    pre, post, res = _leaves(torch.float32, (8, 2, 4), (8, 2, 4), (8, 2, 4, 4))
    _backward(stream_mix.stream_read(state, pre))
    _backward(stream_mix.stream_write(state, out, post, res, 20))
    _backward(stream_mix.width_read(state, pre))
    _backward(stream_mix.depth_write(state, res, post, out))


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    JITFunction.run = compile_launch
    for dtype in (torch.bfloat16, torch.float32):
        launch_every_kernel(dtype)
    print(
        f"compiled {len(compiled)} kernel specialisations for sm_90 (triton {triton.__version__})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
