"""The sublayers of a layer: the local mixer (ShortSWA) when it is on, attention, the MLP.

Designs and the registry both read these (light: the mixer's declaration only)."""

from __future__ import annotations

from t2train.residual.declaration import LocalMixer
from t2train.residual.shortswa import MIXER


def mixer() -> LocalMixer:
    """The ``LocalMixer`` (ShortSWA)."""
    return MIXER


def mixer_on(model) -> bool:
    """``model``: a ``ModelConfig``, or the ``model`` mapping of a saved config."""
    if isinstance(model, dict):
        return mixer().options(**(model.get(mixer().section) or {})).enabled()
    return getattr(model, mixer().section).enabled()


def sublayer_names(model) -> tuple[str, ...]:
    """The sublayers of every layer, in order (``SublayerResidual.position`` indexes them)."""
    return ((mixer().name,) if mixer_on(model) else ()) + ("attn", "mlp")
