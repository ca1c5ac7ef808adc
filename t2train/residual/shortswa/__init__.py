"""The local mixer: sequence-axis short sliding-window attention (ShortSWA) before attention.

Residual Stream Duality (arXiv 2603.16039), Sec. 2.4 and Algorithm 1: before global
attention, every layer adds a pre-norm sublayer of causal attention over the last w tokens,

    S = H + ShortSWA(Norm(H); w),  A = S + Attn(Norm(S)),  H' = A + MLP(Norm(A)),

on when ``model.shortswa.window`` = w > 0. With a residual design other than `standard` the
sublayer's output is written through that design's operator like attention's and the MLP's
(with `ddl` it gets its own delta write; with AttnRes it is a source of its own), so
``S = write(H, ShortSWA(Norm(read(H)); w))``. The paper recommends DDL for the shortcut plus
ShortSWA for local mixing (``model.residual=ddl model.shortswa.window=128``).

The sublayer is Megatron's tensor-parallel ``SelfAttention`` (heads split across TP ranks,
RoPE over tokens) with a windowed core attention: flash-attn's ``window_size=(w - 1, 0)`` on
CUDA, else ``short_window_attention`` (the operator the depth read uses too; the Triton
kernel on CUDA, the PyTorch reference on CPU). Its parameters keep the names of the layer's
``pre_attention`` submodule, so checkpoints of the former `shortswa` design load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from t2train.errors import require
from t2train.residual.declaration import LocalMixer


@dataclass
class ShortSWAOptions:
    """``model.shortswa``: the local mixer, an extra pre-norm sublayer of causal attention
    over the last ``window`` tokens before attention in every layer; 0 turns it off."""

    window: int = 0  # tokens each query attends over, its own included; 0 = the mixer off
    # Start the sublayer's output projection at zero, so it adds nothing until it learns (as
    # the depth read's W_O); false: Megatron's scaled output init, like attention's.
    zero_init_output: bool = False
    not_architecture: ClassVar[tuple] = ("zero_init_output",)  # a resumed run may change it
    default_window: ClassVar[int] = 128  # the companion note's chunk size (Rethinking SWA)

    def enabled(self) -> bool:
        return self.window > 0

    def validate(self, prefix: str) -> None:
        require(
            self.window >= 0,
            f"{prefix}.window",
            self.window,
            "must be >= 0 (0 turns the ShortSWA sublayer off)",
        )


def extra_parameters(model) -> int:
    h, q = model.hidden_size, model.q_dim()
    return model.num_layers * (h * (q + 2 * model.kv_dim()) + q * h + h)  # qkv, proj, norm


def tensor_parallel_parameters(model) -> int:
    """The projections are split like attention's; the norm is not."""
    return extra_parameters(model) - model.num_layers * model.hidden_size


def mean_window(seq_length: int, window: int) -> float:
    """Average number of keys a causal query sees with a window of ``window``."""
    return sum(min(window, pos + 1) for pos in range(seq_length)) / seq_length


def extra_flops_per_token(model) -> float:
    h, q = model.hidden_size, model.q_dim()
    projections = 2 * h * (q + 2 * model.kv_dim()) + 2 * q * h
    scores_and_mix = 4 * q * mean_window(model.seq_length, model.shortswa.window)
    return model.num_layers * (projections + scores_and_mix)


def write_diagnostics(writer, step: int, records: dict, model) -> None:
    """``diagnostics/shortswa_entropy/layer_NN``: mean attention entropy (nats) of the last 128
    queries; log(window) would be uniform attention."""
    if "shortswa_entropy" in records:
        writer.scalars(
            step,
            {
                f"diagnostics/shortswa_entropy/layer_{layer:02d}": float(entropy)
                for layer, entropy in sorted(records["shortswa_entropy"].items())
            },
        )


MIXER = LocalMixer(
    name="shortswa",
    layers="t2train.residual.shortswa.layers",
    section="shortswa",
    options=ShortSWAOptions,
    spec="short_attention_spec",
    reference="Residual Stream Duality, Zhang, arXiv 2603.16039, Sec. 2.4 and Algorithm 1",
    extra_parameters=extra_parameters,
    extra_flops_per_token=extra_flops_per_token,
    tensor_parallel_parameters=tensor_parallel_parameters,
    write_diagnostics=write_diagnostics,
)
