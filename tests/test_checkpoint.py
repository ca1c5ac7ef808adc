"""Megatron dist-checkpoint round trip: a reloaded model and optimizer continue identically."""

from pathlib import Path

import pytest
import torch

from t2train.config.loader import load_config


def _objects(seed: int):
    from megatron.core import parallel_state

    from t2train.parallel.init import Topology, set_seed
    from t2train.train.setup import build_training_objects

    set_seed(seed, Topology(0, 1, 0, 0, parallel_state.get_pipeline_model_parallel_rank(),
                            0, 1, 1, 1))
    config = load_config("tiny", overrides=["data.path=unused", "model.num_layers=2",
                                            "model.seq_length=16", "train.micro_batch_size=2",
                                            "train.global_batch_size=4"])
    return build_training_objects(config, vocab_size=128)


def _steps(objs, count: int, seed: int) -> list[float]:
    from t2train.train.step import train_step

    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(count):
        batches = []
        for _ in range(2):
            tokens = torch.randint(0, 128, (2, 17), generator=g)
            batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
        losses.append(train_step(objs, batches).loss)
    return losses


def _params(objs):
    return {n: p.detach().clone() for n, p in objs.model[0].module.named_parameters()}


def test_save_then_load_into_a_fresh_model(megatron_world, tmp_path: Path):
    from t2train.checkpoint.store import find_latest, load_checkpoint, save_checkpoint

    trained = _objects(seed=1)
    _steps(trained, 3, seed=0)
    path = save_checkpoint(tmp_path, 3, trained, {"tokens": 192})
    assert path.name == "step_00000003" and find_latest(tmp_path) == path
    assert (tmp_path / "latest").read_text().strip() == path.name

    fresh = _objects(seed=2)  # different initial weights
    assert any(not torch.equal(a, b) for a, b in zip(_params(fresh).values(),
                                                     _params(trained).values()))
    state = load_checkpoint(path, fresh)
    assert state["step"] == 3 and state["tokens"] == 192
    for name, value in _params(trained).items():
        assert torch.equal(_params(fresh)[name], value), name
    # Optimizer moments and LR schedule came back too: the next steps are identical.
    assert _steps(fresh, 2, seed=5) == _steps(trained, 2, seed=5)


def test_incomplete_checkpoint_is_ignored(megatron_world, tmp_path: Path):
    from t2train.checkpoint.store import find_latest, save_checkpoint

    objs = _objects(seed=1)
    good = save_checkpoint(tmp_path, 1, objs, {})
    (tmp_path / "step_00000002.incomplete").mkdir()
    with pytest.warns(UserWarning, match="incomplete checkpoint"):
        assert find_latest(tmp_path) == good
