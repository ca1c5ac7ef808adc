"""Config loading and validation: every bad value is named with its rule."""

import pytest

from t2train.config.arguments import preset_names
from t2train.config.loader import dump_config, load_config
from t2train.config.schema import ConfigError

DATA = ["data.path=/some/data"]


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_is_valid(preset):
    config = load_config(preset, overrides=DATA)
    assert config.name == preset


def test_presets_include_cpu_and_gpu_sizes():
    assert {"tiny", "125m", "350m", "1b", "7b"} <= set(preset_names())


def test_overrides_are_typed_and_win():
    config = load_config(
        "tiny",
        overrides=DATA + ["model.num_layers=2", "train.lr=1e-3", "model.tie_embeddings=false"],
    )
    assert config.model.num_layers == 2
    assert config.train.lr == pytest.approx(1e-3)
    assert config.model.tie_embeddings is False


def test_yaml_file_between_preset_and_overrides(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("model:\n  num_layers: 8\n  hidden_size: 128\n")
    config = load_config("tiny", str(file), DATA + ["model.num_layers=2"])
    assert (config.model.num_layers, config.model.hidden_size) == (2, 128)


def test_a_smoke_run_shortens_the_presets_warmup_but_not_a_given_one(tmp_path):
    """tiny warms up for 30 steps: a 10-step run warms up for 1 instead; a warm-up given in an
    override or a config file is the user's and is checked as given."""
    assert load_config("tiny", overrides=DATA).train.warmup_steps == 30
    assert load_config("tiny", overrides=[*DATA, "train.steps=10"]).train.warmup_steps == 1
    assert load_config(overrides=[*DATA, "train.steps=5"]).train.warmup_steps == 0
    with pytest.raises(ConfigError, match="train.warmup_steps=30: must be in"):
        load_config("tiny", overrides=[*DATA, "train.steps=10", "train.warmup_steps=30"])
    file = tmp_path / "run.yaml"
    file.write_text("train:\n  warmup_steps: 12\n")
    with pytest.raises(ConfigError, match="train.warmup_steps=12: must be in"):
        load_config("tiny", str(file), [*DATA, "train.steps=10"])


def test_dump_round_trips(tmp_path):
    config = load_config("tiny", overrides=DATA)
    file = tmp_path / "dumped.yaml"
    file.write_text(dump_config(config))
    assert load_config(config_file=str(file)) == config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.num_layers=0"], "model.num_layers=0: must be >= 1"),
        (["model.num_layers=two"], "model.num_layers='two': must be an integer"),
        (["model.num_layerz=2"], "model.num_layerz: unknown field"),
        (["model.hidden_size=190"], "model.hidden_size=190: must be divisible by"),
        (["model.hidden_size=100"], "head dim hidden_size/num_attention_heads=25 must be even"),
        (["model.residual=magic"], "model.residual='magic': must be one of"),
        (
            ["model.attention_backend=xformers"],
            "model.attention_backend='xformers': must be one of",
        ),
        (["parallel.tensor=3"], "parallel.tensor=3: must divide model.num_attention_heads=4"),
        (["parallel.pipeline=3"], "model.num_layers=4: must be divisible by parallel.pipeline"),
        (
            ["parallel.virtual_pipeline=2"],
            "parallel.virtual_pipeline=2: needs parallel.pipeline > 1",
        ),
        (["train.global_batch_size=12"], "train.global_batch_size=12: must be a multiple of"),
        (["train.min_lr=1.0"], "train.min_lr=1.0: must be in [0, train.lr="),
        (["train.warmup_steps=1000"], "train.warmup_steps=1000: must be in [0, train.steps="),
        (["train.lr_decay_style=step"], "train.lr_decay_style='step': must be one of"),
        (["train.lr_wsd_decay_style=sqrt"], "train.lr_wsd_decay_style='sqrt': must be one of"),
        (["train.lr_wsd_decay_fraction=0"], "train.lr_wsd_decay_fraction=0.0: must be in (0, 1]"),
        (
            ["train.lr_decay_style=wsd", "train.lr_wsd_decay_fraction=1"],
            "train.lr_wsd_decay_fraction=1.0: decays over 300 of train.steps=300; must be 1 to "
            "270 steps (those after train.warmup_steps=30)",
        ),
        (["model=3"], "model=3: must be a mapping"),
        (["novel.field=1"], "novel: unknown field"),
        (["model.num_layers"], "expected dotted.key=value"),
        (["log.diagnostics_interval=-1"], "log.diagnostics_interval=-1: must be >= 0"),
        (["log.peak_tflops=-5"], "log.peak_tflops=-5.0: must be >= 0"),
    ],
)
def test_bad_values_are_named(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=DATA + overrides)
    assert message in str(err.value)


def test_a_preset_shows_without_a_dataset_but_training_needs_one():
    from t2train.train.inputs import dataset_facts

    config = load_config("1b")  # `t2train config --preset 1b` needs no dataset
    assert config.data.path == "" and config.model.vocab_size is None
    with pytest.raises(ConfigError, match="data.path='': must name a prepared dataset"):
        dataset_facts(config)


def test_a_run_shorter_than_the_warmup_is_told_the_fix():
    with pytest.raises(
        ConfigError,
        match=r"train.warmup_steps=30: must be in \[0, "
        r"train.steps=20\); for a run this short set "
        r"train.warmup_steps=2",
    ):
        load_config("tiny", overrides=DATA + ["train.steps=20", "train.warmup_steps=30"])


def test_unknown_preset():
    with pytest.raises(ConfigError, match="preset='huge': unknown preset"):
        load_config("huge", overrides=DATA)


def test_malformed_yaml(tmp_path):
    file = tmp_path / "bad.yaml"
    file.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(config_file=str(file), overrides=DATA)


def test_world_size_must_fit_layout():
    config = load_config("tiny", overrides=DATA + ["parallel.tensor=2"])
    with pytest.raises(ConfigError, match="must divide the world size 3"):
        config.validate_world(3)
    assert config.validate_world(4) == 2


def test_interleaving_needs_micro_batches_divisible_by_pipeline():
    config = load_config(
        "tiny",
        overrides=DATA
        + ["parallel.pipeline=2", "parallel.virtual_pipeline=2", "train.global_batch_size=24"],
    )
    with pytest.raises(ConfigError, match="gives 3 micro-batches per step"):
        config.validate_world(2)


def test_every_design_section_is_a_declared_field_of_the_model_config():
    """``ModelConfig`` declares each design's and the mixer's options as a typed field (no
    class built at import time), and each field's type is the options class the design's own
    declaration names: a section missing or of another class fails here."""
    import typing
    from dataclasses import fields

    from t2train.config.schema import ModelConfig
    from t2train.residual import get_design, mixer, registered
    from t2train.residual.options import DesignOptions

    declared = {mixer().section: mixer().options}
    for name in registered():
        design = get_design(name)
        if design.section is not None:
            assert declared.setdefault(design.section, design.options) is design.options, name
    hints = typing.get_type_hints(ModelConfig)
    assert {f.name: hints[f.name] for f in fields(DesignOptions)} == declared
    assert ModelConfig.__module__ == "t2train.config.schema"  # a class in the source, not made
    config = load_config("tiny", overrides=DATA + ["model.hc.expansion_rate=2"])
    assert config.model.hc.expansion_rate == 2 and config.model.mhc.expansion_rate == 4
    with pytest.raises(ConfigError, match="model.ddl.dv"):
        load_config("tiny", overrides=DATA + ["model.ddl.dv=0"])
