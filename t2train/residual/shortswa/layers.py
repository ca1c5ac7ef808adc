"""The training modules of the local mixer `shortswa` (its math: ``__init__.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor

from t2train.nn import probe
from t2train.nn.attention import CausalCoreAttention
from t2train.nn.specs import self_attention_spec
from t2train.residual.window_attention import attend_window, window_attention_entropy, window_mask


class ShortWindowCoreAttention(CausalCoreAttention):
    """Causal attention over the last ``model.shortswa.window`` tokens (ShortSWA).

    flash-attn's ``window_size=(w - 1, 0)`` on CUDA, else ``short_window_attention`` (the
    same operator the depth read uses): the Triton kernel on CUDA, the PyTorch reference on
    CPU (see ``t2train.kernels.dispatch``). Those have no dropout: with attention dropout, SDPA
    runs over the window's band instead (an s x s mask).
    """

    def __init__(self, config, *args, window: int, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.window = window

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, dropout: float) -> Tensor:
        probe.record(
            "shortswa_entropy",
            self.layer_number,
            lambda: window_attention_entropy(
                query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), self.window, self.softmax_scale
            ),
        )
        if self.backend == "flash":
            from flash_attn import flash_attn_func  # noqa: PLC0415 - flash-attn: optional, CUDA only

            q, k, v = (t.transpose(0, 1) for t in (query, key, value))
            out = flash_attn_func(
                q,
                k,
                v,
                dropout_p=dropout,
                softmax_scale=self.softmax_scale,
                causal=True,
                window_size=(self.window - 1, 0),
            )
            return out.transpose(0, 1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if dropout > 0:  # the kernel and the reference have none: SDPA over the window band
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=window_mask(q.shape[2], k.shape[2], self.window, q.device),
                dropout_p=dropout,
                scale=self.softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )
        else:
            out = attend_window(q, k, v, self.window, self.softmax_scale)
        return out.permute(2, 0, 1, 3)


class ShortSWAAttention(SelfAttention):
    """Megatron's ``SelfAttention``; its output projection starts at zero with
    ``model.shortswa.zero_init_output``."""

    def __init__(self, config, *args, zero_init_output: bool, **kwargs):
        super().__init__(config, *args, **kwargs)
        if zero_init_output:
            with torch.no_grad():
                self.linear_proj.weight.zero_()


def short_attention_spec(options) -> ModuleSpec:
    """The sublayer for ``model.shortswa`` (a ``ShortSWAOptions``)."""
    return self_attention_spec(
        core_attention=ModuleSpec(
            module=ShortWindowCoreAttention, params={"window": options.window}
        ),
        module=ShortSWAAttention,
        zero_init_output=options.zero_init_output,
    )


KERNELS = ()  # the fused kernels this design declares (the registry's kernel table)
