"""``--designs``: variants with model options of their own, and the mistakes refused."""

from __future__ import annotations

import pytest

from t2train.bench.variants import variant_config, variant_names
from t2train.config.schema import ConfigError
from t2train.residual import variant_label


def test_a_variant_with_its_own_model_option_next_to_the_plain_one():
    names = variant_names("ddl,ddl:model.ddl.dv=4,ddl+shortswa")
    configs = [variant_config("tiny", None, ["model.shortswa.window=32"], name) for name in names]
    assert [(variant_label(c.model), c.model.ddl.dv, c.model.shortswa.window) for c in configs] == [
        ("ddl", 1, 0),
        ("ddl", 4, 0),
        ("ddl+shortswa", 1, 32),
    ]


@pytest.mark.parametrize(
    "designs, named",
    [
        ("ddl,ddl", "'ddl' given more than once"),
        ("ddl:train.seed=3", "is not a model.key=value override"),
        ("ddl:model.ddl.dv", "is not a model.key=value override"),
        ("standard:model.residual=ddl", "its overrides make it 'ddl'"),
        ("nonesuch", "unknown residual design"),
    ],
)
def test_mistakes_are_named(designs, named):
    with pytest.raises(ConfigError, match=named):
        for name in variant_names(designs):
            variant_config("tiny", None, [], name)
