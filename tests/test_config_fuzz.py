"""Property-based: any config input gives a valid ``Config`` or one clean ``ConfigError``.

Random dotted overrides over the real dataclass fields (values of every type, NaN/inf, huge
and negative numbers, nested mappings, lists, None, unknown fields) and random or malformed
YAML text go through ``t2train.config.loader``; nothing may escape as another exception
(TypeError, ValueError, OverflowError, RecursionError, ...), and an accepted config must hold
what the schema promises (types, finite numbers) and survive a dump/load round trip.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from t2train.config.loader import dump_config, load_config, load_yaml_file, parse_override
from t2train.config.schema import Config, ConfigError
from t2train.errors import UserInputError

FUZZ = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _leaves(cls: type, prefix: str = "") -> dict[str, typing.Any]:
    """Dotted name -> declared type of every leaf field of the schema."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out.update(_leaves(kind, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = kind
    return out


FIELDS = _leaves(Config)
SECTIONS = sorted({name.split(".")[0] for name in FIELDS if "." in name})

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=300),
    st.integers(),
    st.sampled_from([2**31, 2**63, -(2**63) - 1, 10**30, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 1e308, float("nan"), float("inf"), float("-inf")]),
    st.text(max_size=12),
    st.sampled_from(
        [
            "auto",
            "none",
            "full",
            "sdpa",
            "flash",
            "fp32",
            "bf16",
            "ddl",
            "block_attnres",
            "cached",
            "nan",
            "-inf",
            "1e400",
            "1e-3",
            "yes",
            "~",
            "SIGUSR1",
            "SIGKILL",
            "a=1,b=2",
            "x=nan",
            "2024-13-45",
            "0x10",
            "1_000",
        ]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
keys = st.one_of(
    st.sampled_from(sorted(FIELDS)),
    st.sampled_from(SECTIONS),
    st.builds(
        lambda s, f: f"{s}.{f}",
        st.sampled_from(SECTIONS + ["nosuch"]),
        st.text("abcdefghijklmnopqrstuvwxyz_.", max_size=10),
    ),
    st.text(max_size=15),
)


def _render(value, style: int) -> str:
    """An override's text as a user could type it: YAML flow, Python repr, or str."""
    if style == 0:
        text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
        return text[:-3].strip() if text.endswith("\n...") else text
    return repr(value) if style == 1 else str(value)


def _check_accepted(config: Config) -> None:
    """What a validated config promises: declared types, finite numbers, a round trip."""
    assert isinstance(config, Config)
    for name, kind in FIELDS.items():
        value = config
        for part in name.split("."):
            value = getattr(value, part)
        options = typing.get_args(kind) if typing.get_origin(kind) is typing.Union else (kind,)
        if value is None:
            assert type(None) in options, name
            continue
        kind = next(k for k in options if k is not type(None))
        if typing.get_origin(kind) is typing.Literal:
            assert value in typing.get_args(kind), (name, value)
        elif kind is float:
            assert type(value) is float and math.isfinite(value), (name, value)
        elif kind is int:
            assert type(value) is int and -(2**63) <= value < 2**63, (name, value)
        else:
            assert type(value) is kind, (name, value)
    again = yaml.safe_load(dump_config(config))
    from t2train.config.loader import _build

    assert _build(Config, again, "") == config


def _load(overrides: list[str], config_file: str | None = None):
    try:
        config = load_config("tiny", config_file, overrides)
    except UserInputError as err:
        message = str(err)
        assert message and "\n" not in message, message  # one line for `error: ...`
        assert len(message) < 2000, message
        return err
    _check_accepted(config)
    return config


@FUZZ
@given(st.lists(st.tuples(keys, values, st.integers(0, 2)), max_size=4))
@example([("train.lr", float("nan"), 0)])
@example([("train.lr", float("inf"), 0)])
@example([("model.norm_epsilon", 10**400, 2)])
@example([("train.seed", 2**40, 0)])
@example([("model.num_layers", True, 0)])
@example([("model.attention_backend", 1, 0)])
@example([("model.recompute", ["full"], 0)])
@example([("model.residual", [], 0)])  # a list is no design name (nor an old spelling)
@example([("model", {1: 2, "a": 3}, 0)])
@example([("data.mix", "a=nan", 2)])
@example([("train.exit_signals", 5, 0)])
@example([("\n", None, 0)])
def test_random_overrides_give_a_config_or_a_config_error(items):
    overrides = ["data.path=/some/data"]
    for key, value, style in items:
        overrides.append(f"{key}={_render(value, style)}")
    _load(overrides)


@FUZZ
@given(st.text(max_size=80))
@example("model.num_layers=!!python/object/apply:os.system ['true']")
@example("train.lr=2024-13-45")
@example("train.steps=" + "9" * 5000)
@example("model.seq_length=" + "[" * 2000)
@example("model..x=1")
@example("=")
def test_parse_override_is_clean_on_any_text(text):
    try:
        path, _ = parse_override(text)
    except UserInputError:
        return
    assert path and all(path)


yaml_docs = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.one_of(
                st.sampled_from(SECTIONS + sorted(FIELDS)),
                st.text(max_size=6),
                st.integers(),
                st.none(),
                st.booleans(),
            ),
            inner,
            max_size=4,
        ),
    ),
    max_leaves=12,
)


def _mutate(text: str, cut: int, insert: str) -> str:
    cut = cut % (len(text) + 1)
    return text[:cut] + insert + text[cut:]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@FUZZ
@given(
    doc=yaml_docs,
    cut=st.integers(0, 10**4),
    insert=st.sampled_from(
        [
            "",
            ":",
            "- ",
            "\t",
            "&a",
            "*a",
            "!!python/name:os.system",
            "!!binary",
            "{",
            "]",
            "\x00",
            "'",
            "%YAML 1.1\n---\n",
            "<<: *a",
            "!!float",
            "!!int",
            "\n  ",
            "\ufeff",
            "\x85",
        ]
    ),
    raw=st.one_of(st.none(), st.text(max_size=60), st.binary(max_size=40)),
)
@example(doc=None, cut=0, insert="", raw="!!python/object/apply:os.system ['true']\n")
@example(doc=None, cut=0, insert="", raw="model: !!python/object/apply:os.system ['true']\n")
@example(doc=None, cut=0, insert="", raw="train: {lr: .nan, steps: .inf}\n")
@example(doc=None, cut=0, insert="", raw="when: 2024-13-45\n")
@example(doc=None, cut=0, insert="", raw="a: " + "[" * 3000 + "\n")
@example(doc=None, cut=0, insert="", raw="train: {steps: " + "9" * 5000 + "}\n")
@example(doc=None, cut=0, insert="", raw="1: 2\nnull: 3\nmodel: {}\n")
@example(doc=None, cut=0, insert="", raw=b"model:\n  residual: \xff\xfe\n")
@example(doc=None, cut=0, insert="", raw="a: &a [x, x]\nb: &b [*a, *a]\nmodel: *b\n")
def test_random_yaml_files_give_a_config_or_a_config_error(scratch, doc, cut, insert, raw):
    if raw is None:
        text = _mutate(yaml.safe_dump(doc, default_flow_style=False), cut, insert)
        raw = text
    file = scratch / "fuzz.yaml"
    if isinstance(raw, bytes):
        file.write_bytes(raw)
    else:
        file.write_text(raw, encoding="utf-8", errors="surrogatepass")
    try:
        data = load_yaml_file(str(file))
    except UserInputError as err:
        assert str(err) and "\n" not in str(err)
        return
    assert isinstance(data, dict)
    _load(["data.path=/some/data"], str(file))


# --- the faults the fuzzing found, pinned with their messages -------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=.nan", "train.lr=nan: must be a finite number"),
        ("train.lr=nan", "train.lr='nan': must be a finite number"),
        ("train.clip_grad=.inf", "train.clip_grad=inf: must be a finite number"),
        (
            "train.exit_duration_mins=1e400",
            "train.exit_duration_mins='1e400': must be a finite number",
        ),
        ("model.norm_epsilon=" + "1" * 400, "model.norm_epsilon=1111111111"),
        (
            "train.steps=" + "9" * 5000,
            "...: not a valid YAML value (ValueError: Exceeds the limit (4300 digits)",
        ),
        ("train.seed=4294967296", "train.seed=4294967296: must be in [0, 2**31)"),
        ("model.num_layers=true", "model.num_layers=True: must be an integer"),
        (
            "model.num_layers=9223372036854775808",
            "model.num_layers=9223372036854775808: must be an integer in [-2**63, 2**63)",
        ),
        ("model.attention_backend=1", "model.attention_backend=1: must be one of"),
        ("model.recompute=[full]", "model.recompute=['full']: must be one of"),
        ("train.lr=2024-13-45", "override 'train.lr=2024-13-45': not a valid YAML value"),
        (
            "data.path=!!python/object/apply:os.system ['true']",
            "override \"data.path=!!python/object/apply:os.system ['true']\": "
            "not a valid YAML value",
        ),
    ],
)
def test_found_faults_are_clean_config_errors(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=["data.path=/some/data", override])
    assert message in str(err.value)
    assert len(str(err.value)) < 400


@pytest.mark.parametrize(
    "text, message",
    [
        ("1: 2\nnull: 3\n", "1: unknown field"),
        ("model: !!python/object/apply:os.system ['true']\n", "could not determine a constructor"),
        ("x: !!python/name:os.system\n", "could not determine a constructor"),
        ("when: 2024-13-45\n", "not valid YAML (ValueError: month must be in 1..12)"),
        ("a: " + "[" * 3000 + "\n", "exceeded maximum nesting depth"),
    ],
)
def test_found_yaml_faults_are_clean_config_errors(tmp_path, text, message):
    file = tmp_path / "bad.yaml"
    file.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config("tiny", str(file), ["data.path=/some/data"])
    assert message in str(err.value) and str(file) in str(err.value) or message in str(err.value)


def test_a_yaml_file_that_is_not_utf8_or_a_file_is_named(tmp_path):
    file = tmp_path / "latin1.yaml"
    file.write_bytes(b"model:\n  residual: \xe9\n")
    with pytest.raises(ConfigError, match=r"latin1.yaml: not UTF-8 text"):
        load_yaml_file(str(file))
    with pytest.raises(ConfigError, match=r"is a directory, not a file"):
        load_yaml_file(str(tmp_path))
