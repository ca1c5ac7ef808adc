"""The seams between layers that imports do not show.

* The model's run-time interface: code outside ``t2train/model/`` calls a chunk's
  ``start_schedule()``, ``traffic``, ``stream_norms()``, ``whole_model_name()`` and
  ``layers_and_stream()`` (``T2GPTModel``), never an attribute
  of its decoder: an attribute chain into the decoder couples an engine to the decoder's
  internals without an import for the layer check (tests/test_layering.py) to see.
* Every engine implements the whole ``Engine`` protocol.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from test_layering import REPO

from t2train.engine import Engine, build_engine

INTERFACE = (
    "start_schedule",
    "decode",
    "traffic",
    "stream_norms",
    "whole_model_name",
    "layers_and_stream",
)


def _decoder_reaches(root: Path) -> list[str]:
    """``file:line`` of each ``<anything>.decoder`` in ``t2train/`` outside ``model/`` (the
    packages that hold model chunks; data/'s tokenizer has a decoder of its own)."""
    found = []
    for path in sorted((root / "t2train").rglob("*.py")):
        if path.is_relative_to(root / "t2train" / "model"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "decoder":
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_nothing_outside_the_model_reaches_into_the_decoder():
    assert _decoder_reaches(REPO) == [], (
        f"call the chunk's interface (T2GPTModel: {', '.join(INTERFACE)}) or add a method there"
    )


def test_a_planted_reach_into_the_decoder_is_caught(tmp_path):
    (tmp_path / "t2train" / "model").mkdir(parents=True)
    (tmp_path / "t2train" / "model" / "gpt.py").write_text("x = self.decoder.layers\n")
    (tmp_path / "t2train" / "engine.py").write_text(
        "def step(chunk):\n    chunk.module.decoder.traffic.reset()\n"
    )
    assert _decoder_reaches(tmp_path) == ["t2train/engine.py:2"]


def test_the_model_offers_the_interface():
    from t2train.model.gpt import T2GPTModel

    assert all(hasattr(T2GPTModel, name) for name in INTERFACE)


def _protocol_members(protocol: type) -> set[str]:
    own = set(vars(protocol)) | set(getattr(protocol, "__annotations__", {}))
    return {name for name in own if not name.startswith("_")}


def test_every_engine_implements_the_whole_protocol():
    from t2train.engine.deepspeed.engine import DeepSpeedEngine
    from t2train.engine.megatron import MegatronEngine

    members = _protocol_members(Engine)
    assert {"train_step", "evaluate", "save", "load", "model"} <= members
    methods = {name for name in members if callable(getattr(Engine, name, None))}
    built_with = list(inspect.signature(build_engine).parameters)
    for engine in (MegatronEngine, DeepSpeedEngine):
        missing = [name for name in methods if not inspect.isfunction(_own(engine, name))]
        assert missing == [], f"{engine.__name__} lacks {missing}"
        # build_engine hands each engine what it was given, init_from's weights included
        assert list(inspect.signature(engine).parameters) == built_with, engine.__name__


def _own(cls: type, name: str):
    """``name`` as ``cls`` or one of its bases defines it (not the protocol's stub)."""
    for klass in cls.__mro__:
        if klass is not Engine and name in vars(klass):
            return vars(klass)[name]
    return None
