"""The training modules of `mhc` (the design and its math: ``__init__.py``)."""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from torch.utils.weak import WeakTensorKeyDictionary

from t2train.kernels import dispatch
from t2train.residual.base import mark_replicated
from t2train.residual.mhc.compiled import MHC_CONNECT_BACKWARD, Read, Write, connect
from t2train.residual.mhc.functional import (
    flat_rms_projection,
    mapping_logits,
    sinkhorn,
    stream_read,
    stream_write,
    write_mappings,
)
from t2train.residual.streams import StreamCopies, StreamMixResidual, record_weights
from t2train.residual.sublayers import sublayer_names


def normed_projection(state: Tensor, projection: Tensor, eps: float) -> Tensor:
    """``flat_rms_projection`` [s, b, outputs] (state [n, s, b, h]), recomputed in the
    backward: only the stream and the projection are kept for it, not the fp32 copy of the
    n streams its einsum makes. (Compiled, the read is ``compiled.connect``.)"""
    return checkpoint(flat_rms_projection, state, projection, eps, use_reentrant=False)


def read_streams(state: Tensor, pre_logit: Tensor) -> Tensor:
    """``stream_read``, through the fused Triton kernel where ``T2_KERNELS`` routes it."""
    return dispatch.route(STREAM_READ, state, pre_logit)(state, pre_logit)


def write_streams(
    state: Tensor, out: Tensor, post_logit: Tensor, res_logit: Tensor, iterations: int
) -> Tensor:
    """``stream_write``, through the fused Triton kernel where ``T2_KERNELS`` routes it."""
    write = dispatch.route(STREAM_WRITE, state, out, post_logit, res_logit)
    return write(state, out, post_logit, res_logit, iterations)


def write_weights(post_logit: Tensor, res_logit: Tensor, iterations: int) -> tuple:
    """``write_mappings`` (H_post, H_res), through the fused Triton kernel where ``T2_KERNELS``
    routes it: one narrow kernel each way, where the iterations unrolled are dozens."""
    return dispatch.route(WRITE_MAPPINGS, post_logit)(post_logit, res_logit, iterations)


STREAM_READ = dispatch.Kernel("stream_read", "t2train.kernels.stream_mix:stream_read", stream_read)
STREAM_WRITE = dispatch.Kernel(
    "stream_write", "t2train.kernels.stream_mix:stream_write", stream_write
)
WRITE_MAPPINGS = dispatch.Kernel(
    "mhc_write_mappings", "t2train.kernels.stream_mix:write_mappings", write_mappings
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

    def read_normed(self, state: Tensor, norm) -> tuple[Tensor, Tensor]:
        if not torch.compiler.is_compiling():
            return super().read_normed(state, norm)
        x, normed, self._pending = self._connected_read(state)
        return x, normed

    def width_connection(self, state: Tensor) -> tuple[Tensor, tuple]:
        if torch.compiler.is_compiling():
            # its x has no gradient: the norm's backward is the read's (``read_normed``)
            raise RuntimeError("compiled mhc reads through read_normed, not read")
        with self._saving():
            pre, post, res = self.logits(state)
            self._record(torch.sigmoid(pre), post, res)
            return read_streams(state, pre), (post, res)

    def depth_connection(self, state: Tensor, pending: tuple, out: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return self._connected_write(pending, out)
        post, res = pending
        with self._saving():
            new = write_streams(state, out, post, res, self.iterations)
        if self.drops_its_output and self.dropped is not None and torch.is_grad_enabled():
            self.dropped.register(new, state, out, post, res, self.iterations)
        return new

    # Compiled: reads and writes as ``connect`` (``compiled.py``) pairs them.

    def _connected_read(self, state: Tensor) -> tuple[Tensor, Tensor, tuple]:
        streams, x, normed, projected, read_weights = self.handed_read(connect, state, self.eps)
        _, post, res = mapping_logits(projected, self.gates, self.bias, self.n)
        self._record(read_weights, post, res)
        return x, normed, (streams, post, res)

    def _connected_write(self, pending: tuple, out: Tensor) -> Tensor:
        streams, post, res = pending
        gains, mixing = write_weights(post, res, self.iterations)
        return self.write_handing_on(connect, streams, self.eps, Write(out, mixing, gains))

    def read_part(self) -> Read:
        return Read(self.projection, self.gates[:1], self.bias[: self.n], self.pre_norm.weight)

    def _record(self, read: Tensor, post: Tensor, res: Tensor) -> None:
        record_weights(
            "mhc",
            (self.layer_number, self.position),
            read,
            2 * torch.sigmoid(post),
            lambda: sinkhorn(res, self.iterations),
        )

    def _saving(self):
        """Where the states this sublayer saves may be recipes (``recompute_streams``)."""
        return self.dropped.hooks() if self.dropped is not None else contextlib.nullcontext()


class ManifoldStreamCopies(StreamCopies):
    section = "mhc"


KERNELS = (
    STREAM_READ,
    STREAM_WRITE,
    WRITE_MAPPINGS,
    MHC_CONNECT_BACKWARD,
)  # the fused kernels this design declares (the registry's kernel table)
