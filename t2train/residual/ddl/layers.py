"""The training modules of `ddl` (the design and its math: ``__init__.py``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from t2train.kernels import dispatch
from t2train.nn import probe
from t2train.nn.functional import at_least_fp32
from t2train.nn.precision import fp32_linear
from t2train.residual.base import ResidualStream, SublayerResidual, mark_replicated
from t2train.residual.ddl.compiled import delta_write_fused
from t2train.residual.ddl.functional import channel_mix, delta_write, normalized_direction


def write_delta(
    state: Tensor, out: Tensor, beta_logit: Tensor, v_logit: Tensor, k_eps: float, v_scale: float
) -> Tensor:
    """``delta_write``, through the fused Triton kernel where ``T2_KERNELS`` routes it."""
    write = dispatch.route(DELTA_WRITE, state, out, beta_logit, v_logit)
    return write(state, out, beta_logit, v_logit, k_eps, v_scale)


DELTA_WRITE = dispatch.Kernel("delta_write", "t2train.kernels.ddl_update:delta_write", delta_write)


class ChannelMixRead(torch.nn.Module):
    """The folded CC compressor: x_in[..., i] = sum_j w[j, i] X_j[..., i]."""

    def __init__(self, hidden: int, dv: int, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((dv, hidden), 1.0 / dv, dtype=dtype))

    def forward(self, state: Tensor) -> Tensor:
        return channel_mix(state, self.weight)


class DeltaResidual(SublayerResidual):
    def __init__(self, config, model, layer_number: int = 1, position: int = 0):
        super().__init__(config, model, layer_number, position)
        options = self.model.ddl
        self.dv, self.k_eps, self.v_scale = options.dv, options.k_eps, options.v_scale
        h, dtype = config.hidden_size, config.params_dtype
        self.beta_proj = torch.nn.Linear(h, 1, dtype=dtype)
        self.v_proj = torch.nn.Linear(h, self.dv, dtype=dtype)
        with torch.no_grad():
            config.init_method(self.beta_proj.weight)
            config.init_method(self.v_proj.weight)
            self.beta_proj.bias.fill_(math.log(options.beta_init / (2 - options.beta_init)))
            self.v_proj.bias.zero_()
        self.compressor = ChannelMixRead(h, self.dv, dtype) if self.dv > 1 else None
        mark_replicated(self, config)

    def read(self, state: Tensor) -> Tensor:
        return state if self.compressor is None else self.compressor(state)

    def write(self, state: Tensor, x: Tensor, normed: Tensor, out: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # fused into the add's pass, fp32 recomputed; beta's
            # logit from x and the pre-norm's weight (its backward reads no normed input)
            self._record(state, out, lambda: fp32_linear(normed, self.beta_proj))
            return delta_write_fused(
                state, x, self.pre_norm, out, self.beta_proj, self.v_proj, self.k_eps, self.v_scale
            )
        beta_logit = fp32_linear(normed, self.beta_proj)  # the authors' fp32 gate logits
        self._record(state, out, lambda: beta_logit)
        return write_delta(
            state, out, beta_logit, fp32_linear(x, self.v_proj), self.k_eps, self.v_scale
        )

    def _record(self, state: Tensor, out: Tensor, beta_logit) -> None:
        sublayer = (self.layer_number, self.position)
        probe.record("ddl_beta", sublayer, lambda: 2 * torch.sigmoid(beta_logit().float()))
        probe.record(
            "ddl_kx",
            sublayer,
            lambda: (  # the readout k^T X that v replaces
                normalized_direction(out, self.k_eps) * at_least_fp32(state)
            ).sum(-1),
        )


class DeltaStream(ResidualStream):
    """d_v = 1: the state is [s, b, h]. d_v > 1: [d_v, s, b, h], d_v units per hop."""

    def __init__(self, config, model, pre_process: bool, post_process: bool, first_layer: int):
        super().__init__(config, model, pre_process, post_process, first_layer)
        options = self.model.ddl
        self.dv, h = options.dv, config.hidden_size
        self.expander = self.final_read = None
        if self.dv > 1 and pre_process:
            kernel = options.embed_conv_kernel
            self.entry_context = kernel - 1
            self.expander = torch.nn.Conv1d(
                h, h * self.dv, kernel, groups=h, bias=False, padding=0, dtype=config.params_dtype
            )
            with torch.no_grad():  # identity: every d_v column starts as the embedding
                self.expander.weight.zero_()
                self.expander.weight[:, 0, -1] = 1.0
        if self.dv > 1 and post_process:
            self.final_read = ChannelMixRead(h, self.dv, config.params_dtype)
        mark_replicated(self, config)

    def enter(self, embedding: Tensor) -> Tensor:
        if self.expander is None:
            return embedding
        s, b, h = embedding.shape
        tokens = F.pad(embedding.permute(1, 2, 0), (self.expander.kernel_size[0] - 1, 0))
        return self.expander(tokens).view(b, h, self.dv, s).permute(2, 3, 0, 1).contiguous()

    def exit(self, state: Tensor) -> Tensor:
        return state if self.final_read is None else self.final_read(state)

    def to_units(self, state: Tensor) -> list[Tensor]:
        return [state] if self.dv == 1 else list(state.unbind(0))

    def from_units(self, units: list[Tensor], layers_done: int) -> Tensor:
        return units[0] if self.dv == 1 else torch.stack(units)


KERNELS = (DELTA_WRITE,)  # the fused kernels this design declares (the registry's kernel table)
