"""``standard`` for the Hugging Face export: x <- x + f(norm(x)), on [batch, seq, hidden].

An export part (``t2train/residual/hf.py`` says how it is assembled); its parameters are
named as in ``layers.py``.
"""

from __future__ import annotations

from torch import Tensor, nn

from t2train.residual.hf_modeling import Stream, T2TrainConfig


class HiddenStateStream(Stream):
    """The state is the hidden tensor [b, s, h]."""

    def __init__(self, config: T2TrainConfig):
        super().__init__()

    def enter(self, embedding: Tensor) -> Tensor:
        return embedding

    def exit(self, state: Tensor) -> Tensor:
        return state


class AdditiveResidual(nn.Module):
    def __init__(self, config: T2TrainConfig, layer: int, position: int):
        super().__init__()

    def read(self, state: Tensor) -> Tensor:
        return state

    def write(self, state: Tensor, x: Tensor, normed: Tensor, out: Tensor) -> Tensor:
        return state + out


# model.residual -> (stream, sublayer residual, layer entry or None)
EXPORTED = {"standard": (HiddenStateStream, AdditiveResidual, None)}
