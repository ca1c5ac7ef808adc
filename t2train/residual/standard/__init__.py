"""`standard`: the pre-norm additive residual, x <- x + f(Norm(x)).

The stream state is the hidden tensor [s, b, h]; one unit crosses each pipeline hop.
"""

from __future__ import annotations

from t2train.residual.declaration import BODY, ResidualDesign, Traffic, no_extra


def minimum_traffic(_model, _layer: int) -> Traffic:
    """Forward, the add reads the state and the output and writes the new state and, in the
    same pass, the next sublayer's normed input (4); backward, one pass reads the new state's
    gradient, the normed input's gradient and the state, and writes the state's (4)."""
    return Traffic(BODY.forward + 4, BODY.backward + 4)


DESIGN = ResidualDesign(
    name="standard",
    layers="t2train.residual.standard.layers",
    stream="HiddenStateStream",
    sublayer="AdditiveResidual",
    reference="pre-norm residual (Xiong et al. 2020, arXiv 2002.04745)",
    extra_parameters=no_extra,
    extra_flops_per_token=no_extra,
    minimum_traffic=minimum_traffic,
)
