"""`standard`: the pre-norm additive residual, x <- x + f(Norm(x)).

The stream state is the hidden tensor [s, b, h]; one unit crosses each pipeline hop.
"""

from __future__ import annotations

from t2train.residual.declaration import ResidualDesign, no_extra

DESIGN = ResidualDesign(
    name="standard",
    layers="t2train.residual.standard.layers",
    stream="HiddenStateStream",
    sublayer="AdditiveResidual",
    reference="pre-norm residual (Xiong et al. 2020, arXiv 2002.04745)",
    extra_parameters=no_extra,
    extra_flops_per_token=no_extra,
)
