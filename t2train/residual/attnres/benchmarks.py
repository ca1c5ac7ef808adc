"""Block AttnRes at a preset's shapes: one block's S = ``model.attnres.block_size`` sublayer
reads over the N sources of the preset's last block (one per completed block), the two
phases' kernels against one reference read per sublayer and ``flash-attn-res`` where
installed.

Bytes: the N sources and S partial sums in, S outputs out; in the backward N + S inputs and
S output gradients in, N + S gradients out."""

from __future__ import annotations

import importlib.util
from typing import Iterator

from t2train.kernels.benchmark import Case, Impl, KernelShapes, Runtime
from t2train.residual.attnres import sublayers_per_layer
from t2train.residual.attnres.layers import BLOCK_PHASE_1, BLOCK_PHASE_2, DEPTH_MIX


def depth_mix_cases(shapes: KernelShapes, rt: Runtime) -> Iterator[Case]:
    model = shapes.model
    n_q, eps = model.attnres.block_size, model.attnres.eps
    n_src = sublayers_per_layer(model) * model.num_layers // n_q
    batch, seq, hidden = shapes.batch, shapes.seq, shapes.hidden
    sources = rt.leaf(n_src, batch, seq, hidden)
    partials = [rt.leaf(batch, seq, hidden) for _ in range(n_q)]
    queries = rt.leaf(n_q, hidden, scale=hidden**-0.5)
    inputs = [sources, queries, *partials]

    def two_phase(first, second):
        out, lse, *_ = first()  # ours also hands the sources on
        return [second(partials[i], queries[i], out[i], lse[i], eps) for i in range(n_q)]

    def per_read(mix):
        return [mix(queries[i], [sources], partials[i], eps) for i in range(n_q)]

    depth_mix = DEPTH_MIX.reference
    compiled = rt.compile(depth_mix)
    phase_1, phase_2_handing_on = BLOCK_PHASE_1.triton_function(), BLOCK_PHASE_2.triton_function()

    def phase_2(*args):  # the merge alone (ours also hands the partial sum on)
        return phase_2_handing_on(*args)[0]

    impls = [
        Impl(
            "triton", lambda: two_phase(lambda: phase_1(queries, sources, [], eps), phase_2), inputs
        ),
        Impl("eager", lambda: per_read(depth_mix), inputs),
        Impl("torch.compile", lambda: per_read(compiled), inputs),
    ]
    if rt.on_cuda and importlib.util.find_spec("flash_attn_res") is not None:
        import flash_attn_res as far

        impls.append(
            Impl(
                "flash-attn-res",
                lambda: two_phase(
                    # one [N, ...] tensor, not a list of stacks
                    lambda: far.phase_1_batched_attention_triton_op(queries, sources, eps),
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


# benchmark (``--only``) -> its cases, and the kernels of the table they time
BENCHMARKS = {"depth_mix": (depth_mix_cases, ("block_phase_1", "block_phase_2", "depth_mix"))}
