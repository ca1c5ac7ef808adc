"""The training modules of `hc` (the design and its math: ``__init__.py``)."""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from t2train.kernels import dispatch
from t2train.nn.norm import RMSNorm
from t2train.nn.precision import rms_fp32_logits
from t2train.residual.base import mark_replicated
from t2train.residual.hc.compiled import HC_CONNECT_BACKWARD, Read, Write, connect
from t2train.residual.hc.functional import (
    connection_weights,
    depth_write,
    folded_projections,
    width_read,
)
from t2train.residual.streams import StreamCopies as StreamCopies  # hc's stream, as is
from t2train.residual.streams import StreamMixResidual, record_weights, sublayer_index
from t2train.residual.unrolled import stream_write_fused, weighted_sum

HC_READ = dispatch.Kernel("hc_read", "t2train.kernels.stream_mix:width_read", width_read)
HC_WRITE = dispatch.Kernel("hc_write", "t2train.kernels.stream_mix:depth_write", depth_write)


class HyperConnection(StreamMixResidual):
    def __init__(self, config, model, layer_number: int = 1, position: int = 0):
        super().__init__(config, model, layer_number, position)
        options = self.model.hc
        n, h, dtype = options.expansion_rate, config.hidden_size, config.params_dtype
        self.n, self.dynamic = n, options.dynamic
        alpha = torch.zeros(n, n + 1, dtype=dtype)  # [A_m | A_r]
        alpha[sublayer_index(self.model, layer_number, position) % n, 0] = 1.0
        alpha[:, 1:] = torch.eye(n, dtype=dtype)
        self.static_alpha = torch.nn.Parameter(alpha)
        self.static_beta = torch.nn.Parameter(torch.ones(n, dtype=dtype))
        if self.dynamic:
            self.norm = RMSNorm(config, h, eps=config.layernorm_epsilon)
            self.dynamic_alpha = torch.nn.Parameter(torch.zeros(h, n + 1, dtype=dtype))
            self.dynamic_beta = torch.nn.Parameter(torch.zeros(h, dtype=dtype))
            scale = options.dynamic_scale_init
            self.dynamic_alpha_scale = torch.nn.Parameter(torch.full((1,), scale, dtype=dtype))
            self.dynamic_beta_scale = torch.nn.Parameter(torch.full((1,), scale, dtype=dtype))
        mark_replicated(self, config)

    def weights(self, state: Tensor) -> tuple[Tensor, Tensor]:
        """alpha [s, b, n, n + 1] (A_m, then A_r; row i from stream i) and beta [s, b, n]."""
        tokens = state.shape[1:-1]
        if not self.dynamic:
            return connection_weights(self.static_alpha, self.static_beta, tokens)
        # Both projections of each stream (normed on its own) at once, in fp32 without an
        # fp32 copy of the n streams: [n, s, b, n + 2], alpha's n + 1 logits, then beta's;
        # r (the rsqrt) applies after the projection, so the normed streams are never
        # written (nor saved for the backward).
        folded = folded_projections(self.dynamic_alpha, self.dynamic_beta, self.norm.weight)
        logits = rms_fp32_logits(state, folded, None, cast(float, self.norm.eps))
        scales = (self.dynamic_alpha_scale, self.dynamic_beta_scale)
        return connection_weights(self.static_alpha, self.static_beta, tokens, logits, *scales)

    def read_normed(self, state: Tensor, norm) -> tuple[Tensor, Tensor]:
        if not (self.dynamic and torch.compiler.is_compiling()):
            return super().read_normed(state, norm)
        x, normed, self._pending = self._connected_read(state)
        return x, normed

    def width_connection(self, state: Tensor) -> tuple[Tensor, tuple]:
        if self.dynamic and torch.compiler.is_compiling():
            # its x has no gradient: the norm's backward is the read's (``read_normed``)
            raise RuntimeError("compiled dynamic hc reads through read_normed, not read")
        alpha, beta = self.weights(state)
        read, residual = alpha[..., 0], alpha[..., 1:]
        self._record(read, residual, beta)
        if torch.compiler.is_compiling():  # fused into the norm that follows (``unrolled``)
            return weighted_sum(state, read).to(state.dtype), (residual, beta)
        return dispatch.route(HC_READ, state)(state, read), (residual, beta)

    def depth_connection(self, state: Tensor, pending: tuple, out: Tensor) -> Tensor:
        if self.dynamic and torch.compiler.is_compiling():
            return self._connected_write(state, pending, out)
        residual, beta = pending
        if torch.compiler.is_compiling():  # fused with the passes beside it (``unrolled``)
            return stream_write_fused(state, residual, beta, out)
        write = dispatch.route(HC_WRITE, state, out)
        return write(state, residual, beta, out)

    # Compiled, dynamic: reads and writes as ``connect`` (``hc/compiled.py``) pairs them.

    def _connected_read(self, state: Tensor) -> tuple[Tensor, Tensor, tuple]:
        streams, x, normed, logits, read = self.handed_read(connect, state, self._eps())
        self._record_logits(read, logits)
        return x, normed, (streams, logits)

    def _connected_write(self, _state: Tensor, pending: tuple, out: Tensor) -> Tensor:
        streams, logits = pending
        write = Write(
            out,
            logits,
            self.static_alpha,
            self.static_beta,
            self.dynamic_alpha_scale,
            self.dynamic_beta_scale,
        )
        return self.write_handing_on(connect, streams, self._eps(), write)

    def _eps(self) -> float:
        return cast(float, self.norm.eps)

    def read_part(self) -> Read:
        folded = folded_projections(self.dynamic_alpha, self.dynamic_beta, self.norm.weight)
        return Read(folded, self.static_alpha, self.dynamic_alpha_scale, self.pre_norm.weight)

    def _record_logits(self, read: Tensor, logits: Tensor) -> None:
        tokens = read.shape[:-1]
        scales = (self.dynamic_alpha_scale, self.dynamic_beta_scale)
        alpha, beta = connection_weights(
            self.static_alpha, self.static_beta, tokens, logits, *scales
        )
        self._record(read, alpha[..., 1:], beta)

    def _record(self, read: Tensor, residual: Tensor, beta: Tensor) -> None:
        key = (self.layer_number, self.position)
        record_weights("hc", key, read, beta, lambda: residual.transpose(-1, -2))


KERNELS = (
    HC_READ,
    HC_WRITE,
    HC_CONNECT_BACKWARD,
)  # the fused kernels this design declares (the registry's kernel table)
