"""The training modules of `mhc` (the design and its math: ``__init__.py``)."""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from t2train.kernels import dispatch
from t2train.kernels.ops import composite_op
from t2train.nn.functional import at_least_fp32
from t2train.residual.base import mark_replicated
from t2train.residual.mhc.functional import mapping_logits, sinkhorn, stream_read, stream_write
from t2train.residual.streams import StreamCopies, StreamMixResidual, record_weights
from t2train.residual.sublayers import sublayer_names

# RMSNorm(vec x) phi^T in fp32, as two operators that save the stream as it came: compiled
# as plain torch code, the partitioner kept the fp32 copy of the n streams that the backward's
# matmuls read (2n units per sublayer, beside the n the read and write kernels save).
#
# Each stream is a contiguous [tokens, h] slab, so the projection is one batched matmul over
# the streams (no permuted copy of the stream), summed over them; the RMS divides the result
# (the norm is weight-free, so RMSNorm(x~) phi = (x~ phi) rsqrt(mean(x~^2) + eps)). Backward,
# with g the incoming gradient, r the rsqrt and y = x~ phi^T:
# dx~ = (g r) phi - x~ r^3 sum_k(g_k y_k) / (n h),  dphi = (g r)^T x~.


@composite_op("mhc_normed_projection")
def _normed_projection(
    state: Tensor, projection: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """state [n, s, b, h], projection [outputs, n h] -> the result [s, b, outputs], and the
    backward's y [tokens, outputs] and r [tokens]."""
    n, h = state.shape[0], state.shape[-1]
    with torch.autocast(state.device.type, enabled=False):
        x = at_least_fp32(state).reshape(n, -1, h)  # a temporary, freed after the forward
        phi = at_least_fp32(projection).view(-1, n, h).permute(1, 2, 0)  # [n, h, outputs]
        inv_rms = torch.rsqrt(x.pow(2).sum((0, 2)) / (n * h) + eps)  # [tokens]
        y = torch.bmm(x, phi).sum(0)  # [tokens, outputs]
    return (y * inv_rms[:, None]).view(*state.shape[1:-1], -1), y, inv_rms


@composite_op("mhc_normed_projection_backward")
def _normed_projection_backward(
    grad: Tensor, state: Tensor, projection: Tensor, y: Tensor, inv_rms: Tensor
) -> tuple[Tensor, Tensor]:
    n, h = state.shape[0], state.shape[-1]
    with torch.autocast(state.device.type, enabled=False):
        x = at_least_fp32(state).reshape(n, -1, h)
        phi = at_least_fp32(projection).view(-1, n, h).transpose(0, 1)  # [n, outputs, h]
        g = grad.reshape(-1, grad.shape[-1]).to(y.dtype)
        g_y = g * inv_rms[:, None]
        coef = -(g * y).sum(-1) * inv_rms.pow(3) / (n * h)  # [tokens]
        d_state = torch.baddbmm(x * coef[:, None], g_y.expand(n, *g_y.shape), phi)
        d_phi = torch.bmm(g_y.T.expand(n, *g_y.T.shape), x)  # [n, outputs, h]
    return (
        d_state.view(state.shape).to(state.dtype),
        d_phi.transpose(0, 1).reshape(projection.shape).to(projection.dtype),
    )


def _save_the_stream_as_it_came(ctx, inputs: tuple, output: tuple) -> None:
    state, projection, _ = inputs
    _, y, inv_rms = output
    ctx.save_for_backward(state, projection, y, inv_rms)
    ctx.set_materialize_grads(False)  # y and r are for the backward: no zeros made for them


def _projection_backward(ctx, grad: Tensor, _grad_y, _grad_inv_rms) -> tuple:
    return (*_normed_projection_backward(grad, *ctx.saved_tensors), None)


_normed_projection.register_autograd(
    _projection_backward, setup_context=_save_the_stream_as_it_came
)


def normed_projection(state: Tensor, projection: Tensor, eps: float) -> Tensor:
    """``flat_rms_projection`` [s, b, outputs] (state [n, s, b, h]), saving the
    stream as it came."""
    return _normed_projection(state, projection, eps)[0]


def read_streams(state: Tensor, pre_logit: Tensor) -> Tensor:
    """``stream_read``, through the fused Triton kernel where ``T2_KERNELS`` routes it."""
    return dispatch.route(STREAM_READ, state, pre_logit)(state, pre_logit)


def write_streams(
    state: Tensor, out: Tensor, post_logit: Tensor, res_logit: Tensor, iterations: int
) -> Tensor:
    """``stream_write``, through the fused Triton kernel where ``T2_KERNELS`` routes it."""
    write = dispatch.route(STREAM_WRITE, state, out, post_logit, res_logit)
    return write(state, out, post_logit, res_logit, iterations)


STREAM_READ = dispatch.Kernel("stream_read", "t2train.kernels.stream_mix:stream_read", stream_read)
STREAM_WRITE = dispatch.Kernel(
    "stream_write", "t2train.kernels.stream_mix:stream_write", stream_write
)


class _Recomputed:
    """A stream state dropped after the forward: rebuilt in the backward by the write that
    made it, from the state before (kept, or itself a ``_Recomputed``), the sublayer's
    output and its mappings' logits (saved for the backward anyway). Rebuilt once; the
    backward nodes that saved the state share it."""

    def __init__(self, before, out: Tensor, post: Tensor, res: Tensor, iterations: int):
        self.inputs = (before, out.detach(), post.detach(), res.detach())
        self.iterations = iterations
        self.value: Optional[Tensor] = None

    def materialise(self) -> Tensor:
        if self.value is None:
            before, out, post, res = self.inputs
            if isinstance(before, _Recomputed):
                before = before.materialise()
            with torch.no_grad():
                self.value = write_streams(before, out, post, res, self.iterations)
        return self.value


class _DroppedStates:
    """``saved_tensors_hooks`` that store a registered state as its ``_Recomputed`` recipe."""

    def __init__(self):
        self.recipes = WeakTensorKeyDictionary()  # state -> _Recomputed

    def pack(self, t: Tensor):
        return self.recipes.get(t, t)

    @staticmethod
    def unpack(saved):
        return saved.materialise() if isinstance(saved, _Recomputed) else saved

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def register(
        self, state: Tensor, before: Tensor, out: Tensor, post: Tensor, res: Tensor, iterations: int
    ) -> None:
        before = self.recipes.get(before, before)  # a chain within the layer: never a tensor
        self.recipes[state] = _Recomputed(before, out, post, res, iterations)


DROPPED_STATES = _DroppedStates()


class ManifoldHyperConnection(StreamMixResidual):
    def __init__(self, config, model, layer_number: int = 1, position: int = 0):
        super().__init__(config, model, layer_number, position)
        options = self.model.mhc
        n, h, dtype = options.expansion_rate, config.hidden_size, config.params_dtype
        self.n, self.eps, self.iterations = n, options.eps, options.sinkhorn_iterations
        # with recompute_streams: the states between this layer's sublayers are dropped
        # (the last sublayer's output, the next layer's input, is kept)
        last = position == len(sublayer_names(self.model)) - 1
        self.dropped = DROPPED_STATES if options.recompute_streams else None
        self.drops_its_output = options.recompute_streams and not last
        outputs = n * n + 2 * n  # H~pre, H~post, H~res (row-major)
        self.projection = torch.nn.Parameter(torch.empty(outputs, n * h, dtype=dtype))
        config.init_method(self.projection)
        bias = torch.zeros(outputs, dtype=dtype)
        bias[:n] = -math.log(n - 1) if n > 1 else 0.0  # logit(1/n): H_pre sums to 1
        self.bias = torch.nn.Parameter(bias)
        self.gates = torch.nn.Parameter(torch.full((3,), options.gate_init, dtype=dtype))
        mark_replicated(self, config)

    def logits(self, state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """H~pre [s, b, n], H~post [s, b, n], H~res [s, b, n, n] from the flattened stream."""
        raw = normed_projection(state, self.projection, self.eps)
        return mapping_logits(raw, self.gates, self.bias, self.n)

    def width_connection(self, state: Tensor) -> tuple[Tensor, tuple]:
        with self._saving():
            pre, post, res = self.logits(state)
            record_weights(
                "mhc",
                (self.layer_number, self.position),
                torch.sigmoid(pre),
                2 * torch.sigmoid(post),
                lambda: sinkhorn(res, self.iterations),
            )
            return read_streams(state, pre), (post, res)

    def depth_connection(self, state: Tensor, pending: tuple, out: Tensor) -> Tensor:
        post, res = pending
        with self._saving():
            new = write_streams(state, out, post, res, self.iterations)
        if self.drops_its_output and self.dropped is not None and torch.is_grad_enabled():
            self.dropped.register(new, state, out, post, res, self.iterations)
        return new

    def _saving(self):
        """Where the states this sublayer saves may be recipes (``recompute_streams``)."""
        return self.dropped.hooks() if self.dropped is not None else contextlib.nullcontext()


class ManifoldStreamCopies(StreamCopies):
    section = "mhc"


KERNELS = (
    STREAM_READ,
    STREAM_WRITE,
)  # the fused kernels this design declares (the registry's kernel table)
