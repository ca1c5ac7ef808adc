"""Inputs are data, not code: a config or checkpoint carrying a pickled or tagged Python object
that would run code is refused, and the code does not run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_checkpoint import _objects, _steps

from t2train.checkpoint.errors import CheckpointError
from t2train.config.loader import load_config
from t2train.config.schema import ConfigError


class _Payload:
    """Unpickling this runs ``touch <marker>`` (what an attacker's checkpoint would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_yaml_config_with_a_python_tag_is_refused(tmp_path: Path):
    marker = tmp_path / "ran"
    config = tmp_path / "evil.yaml"
    config.write_text(f'model: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(ConfigError, match="tags that build Python objects are refused"):
        load_config("tiny", str(config), ["data.path=d"])
    with pytest.raises(ConfigError, match="not a valid YAML value"):
        load_config(
            "tiny",
            overrides=["data.path=d", f'name=!!python/object/apply:os.system ["touch {marker}"]'],
        )
    assert not marker.exists()


def test_a_checkpoint_whose_common_pt_runs_code_is_refused(megatron_world, tmp_path: Path):
    """Megatron's common.pt is read with torch.load's weights_only unpickler (torch >= 2.6):
    a pickled callable is refused before it runs, by the loader and by `ckpt inspect`."""
    from t2train.checkpoint.train_state import read_train_state
    from t2train.engine.megatron.checkpoint import load_checkpoint, save_checkpoint

    objs = _objects(seed=1)
    _steps(objs, 1, seed=0)
    path = save_checkpoint(tmp_path / "checkpoints", 1, objs, {"tokens": 1})
    marker = tmp_path / "ran"
    common = torch.load(path / "common.pt", weights_only=True)
    common["train_state"]["payload"] = _Payload(marker)
    torch.save(common, path / "common.pt")

    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, objs)
    assert str(path) in str(err.value) and "UnpicklingError" in str(err.value), err.value
    with pytest.raises(CheckpointError) as err:
        read_train_state(path)
    assert f"{path}/common.pt" in str(err.value) and "\n" not in str(err.value), err.value
    assert not marker.exists()
