"""Megatron dist-checkpoint round trip: a reloaded model and optimizer continue identically;
async saves, retention, refusals of unusable checkpoints, ``t2train ckpt inspect``."""

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from t2train.config.loader import load_config
from t2train.config.schema import CONFIG_FORMAT


def _config(*overrides: str):
    return load_config(
        "tiny",
        overrides=[
            "data.path=unused",
            "model.num_layers=2",
            "model.seq_length=16",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            *overrides,
        ],
    )


def _engine(seed: int, config=None):
    from megatron.core import parallel_state

    from t2train.engine.megatron import MegatronEngine
    from t2train.parallel.init import Topology, set_seed

    set_seed(
        seed, Topology(0, 1, 0, 0, parallel_state.get_pipeline_model_parallel_rank(), 0, 1, 1, 1)
    )
    return MegatronEngine(config or _config(), vocab_size=128)


def _objects(seed: int, config=None):
    return _engine(seed, config).objs


def _steps(objs, count: int, seed: int) -> list[float]:
    from t2train.engine.megatron.step import train_step

    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(count):
        batches = []
        for _ in range(2):
            tokens = torch.randint(0, 128, (2, 17), generator=g)
            batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
        losses.append(train_step(objs, batches).loss)
    return losses


def _spawned_children() -> set[int]:
    """pids of this process's multiprocessing children (an asynchronous save's writer)."""
    import psutil

    found = set()
    for child in psutil.Process().children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.Error:  # ended (an earlier test's writer, not yet reaped)
            continue
    return found


def _params(objs):
    return {n: p.detach().clone() for n, p in objs.model[0].module.named_parameters()}


def test_save_then_load_into_a_fresh_model(megatron_world, tmp_path: Path):
    from t2train.checkpoint.store import find_latest
    from t2train.engine.megatron.checkpoint import load_checkpoint, save_checkpoint

    trained = _objects(seed=1)
    _steps(trained, 3, seed=0)
    before = _spawned_children()  # an earlier test's asynchronous writer may still be ending
    path = save_checkpoint(tmp_path, 3, trained, {"tokens": 192})
    assert path.name == "step_00000003" and find_latest(tmp_path) == path
    # a synchronous save keeps its results in this process: it starts no writer
    assert _spawned_children() <= before
    assert (tmp_path / "latest").read_text().strip() == path.name

    fresh = _objects(seed=2)  # different initial weights
    assert any(
        not torch.equal(a, b) for a, b in zip(_params(fresh).values(), _params(trained).values())
    )
    state = load_checkpoint(path, fresh)
    assert state["step"] == 3 and state["tokens"] == 192
    for name, value in _params(trained).items():
        assert torch.equal(_params(fresh)[name], value), name
    # Optimizer moments and LR schedule came back too: the next steps are identical.
    assert _steps(fresh, 2, seed=5) == _steps(trained, 2, seed=5)


def test_incomplete_checkpoint_is_ignored(megatron_world, tmp_path: Path):
    from t2train.checkpoint.store import find_latest
    from t2train.engine.megatron.checkpoint import save_checkpoint

    objs = _objects(seed=1)
    good = save_checkpoint(tmp_path, 1, objs, {})
    (tmp_path / "step_00000002.incomplete").mkdir()
    with pytest.warns(UserWarning, match="incomplete checkpoint"):
        assert find_latest(tmp_path) == good


def test_async_save_is_published_when_the_writer_is_done(megatron_world, tmp_path: Path):
    from t2train.checkpoint.manager import Checkpointer
    from t2train.engine.megatron.checkpoint import load_checkpoint

    config = _config("checkpoint.async_save=true")
    engine = _engine(seed=1, config=config)
    trained = engine.objs
    _steps(trained, 2, seed=0)
    reports = []
    saver = Checkpointer(tmp_path, config, engine, lambda *args: reports.append(args))
    path = saver.save(2, {"tokens": 64})
    before = _params(trained)
    _steps(trained, 1, seed=3)  # training goes on while the forked writer saves step 2
    assert not path.exists() and not reports  # published only when finalized
    saver.close()
    assert path.is_dir() and (tmp_path / "latest").read_text().strip() == path.name
    ((step, blocked, total, reported),) = reports
    assert (step, reported) == (2, path) and 0 < blocked <= total

    fresh = _objects(seed=2, config=config)
    state = load_checkpoint(path, fresh, config)
    assert state["step"] == 2 and state["config"]["checkpoint"]["async_save"]
    assert state["code_version"]
    for name, value in before.items():  # the state at save time, not after the next step
        assert torch.equal(_params(fresh)[name], value), name


def test_retention_keeps_the_newest_and_every_mth(megatron_world, tmp_path: Path):
    from t2train.checkpoint.manager import Checkpointer
    from t2train.checkpoint.retention import steps_to_delete

    assert steps_to_delete([1, 2, 3, 4, 5, 6], keep_last=2, keep_every=0) == [1, 2, 3, 4]
    assert steps_to_delete([2, 4, 6, 8, 10], keep_last=1, keep_every=4) == [2, 6]
    assert steps_to_delete([1, 2, 3], keep_last=0, keep_every=2) == []  # 0: keep all

    config = _config("checkpoint.keep_last=2", "checkpoint.keep_every=3")
    saver = Checkpointer(tmp_path, config, _engine(seed=1, config=config), lambda *args: None)
    for step in range(1, 6):
        saver.save(step, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_00000003",
        "step_00000004",
        "step_00000005",
    ]


def test_a_checkpoint_of_another_model_is_refused_naming_the_fields(megatron_world, tmp_path: Path):
    from t2train.checkpoint.errors import CheckpointError
    from t2train.engine.megatron.checkpoint import load_checkpoint, save_checkpoint

    config = _config("model.residual=ddl", "model.ddl.dv=1")
    path = save_checkpoint(tmp_path, 1, _objects(seed=1, config=config), {"config": asdict(config)})
    other = _config("model.residual=ddl", "model.ddl.dv=4")
    with pytest.raises(CheckpointError, match=r"model\.ddl\.dv: checkpoint 1, this run 4"):
        load_checkpoint(path, _objects(seed=1, config=other), other)
    standard = _config()
    with pytest.raises(
        CheckpointError, match="model.residual: checkpoint 'ddl', this run 'standard'"
    ) as err:
        load_checkpoint(path, _objects(seed=1, config=standard), standard)
    assert "ddl.dv" not in str(err.value)  # another design's settings are not compared


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_damaged_shard_is_named(megatron_world, tmp_path: Path, damage):
    from t2train.checkpoint.errors import CheckpointError
    from t2train.engine.megatron.checkpoint import load_checkpoint, save_checkpoint

    objs = _objects(seed=1)
    _steps(objs, 1, seed=0)
    path = save_checkpoint(tmp_path, 1, objs, {})
    shard = sorted(path.glob("*.distcp"))[-1]
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:100])
    fresh = _objects(seed=2)
    before = _params(fresh)
    with pytest.raises(CheckpointError, match=f"{shard.name}: shard file {damage}"):
        load_checkpoint(path, fresh)
    assert all(torch.equal(_params(fresh)[n], v) for n, v in before.items())  # untouched


def test_inspect_prints_step_layout_design_and_shards(megatron_world, tmp_path: Path, capsys):
    from t2train.cli import main
    from t2train.engine.megatron.checkpoint import save_checkpoint

    config = _config("model.residual=ddl", "model.shortswa.window=8")
    path = save_checkpoint(
        tmp_path,
        7,
        _objects(seed=1, config=config),
        {
            "config": asdict(config),
            "config_format": CONFIG_FORMAT,
            "tokens": 448,
            "code_version": "0.1+abc",
        },
    )
    assert main(["ckpt", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    for expected in (
        "step 7, tokens 448",
        "TP 1 x PP 1 x DP 1",
        "ddl+shortswa residual, 2 layers",
        "code 0.1+abc",
        "common.pt",
        ".distcp",
    ):
        assert expected in out
    for leading_to_it in (tmp_path, tmp_path / "latest"):  # the checkpoints directory, latest
        assert main(["ckpt", "inspect", str(leading_to_it)]) == 0
        assert f"its newest complete checkpoint is {path}" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["ckpt", "inspect", str(tmp_path / "empty")]) == 2  # one-line error
    assert "not a complete t2train checkpoint, nor a run" in capsys.readouterr().err
    (path / "metadata.json").write_text("{not json")
    assert main(["ckpt", "inspect", str(path)]) == 2
    assert f"{path / 'metadata.json'}: cannot read (JSONDecodeError" in capsys.readouterr().err


def _damage(shard: Path, how: str) -> None:
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    else:  # 4 KiB of random bytes in place, the size unchanged
        data = bytearray(shard.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 4096] = (
            torch.randint(
                0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8
            )
            .numpy()
            .tobytes()
        )
        shard.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "overwritten", "manifest deleted"])
def test_a_damaged_newest_checkpoint_is_skipped_or_refused(
    megatron_world, tmp_path: Path, capsys, how
):
    """The newest checkpoint's shard truncated, or overwritten in place at its own size (which
    loads without an error), or its checksum manifest deleted (its train state says it had
    one): ``checkpoint.resume=auto`` resumes from the step before, saying which checkpoint it
    skipped and why; ``checkpoint.on_damaged=stop`` refuses, naming the checkpoint that
    verifies; a damaged checkpoint named explicitly is refused, naming it too."""
    from t2train.checkpoint.errors import CheckpointError
    from t2train.engine.megatron.checkpoint import save_checkpoint
    from t2train.train.trainer import verified

    root = tmp_path / "run" / "checkpoints"
    objs = _objects(seed=1)
    _steps(objs, 1, seed=0)
    good = save_checkpoint(root, 1, objs, {})
    _steps(objs, 1, seed=1)
    newest = save_checkpoint(root, 2, objs, {})
    assert (newest / "t2train_checksums.json").is_file()
    if how == "manifest deleted":
        shard = newest / "t2train_checksums.json"
        shard.unlink()
        why = "missing (the checkpoint was saved with xxh3_64 checksums"
    else:
        shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
        _damage(shard, how)
        why = "bytes, " if how == "truncated" else "content differs from the xxh3_64 checksum"

    chosen, note = verified(_config(), tmp_path / "run", newest)
    assert chosen == good and note == " | skipped damaged step_00000002"
    warning = capsys.readouterr().err
    assert f"warning: skipping damaged checkpoint {newest}: {shard}: " in warning
    assert why in warning and f"resuming from {good}" in warning, warning

    with pytest.raises(CheckpointError) as refused:
        verified(_config("checkpoint.on_damaged=stop"), tmp_path / "run", newest)
    assert str(refused.value).startswith(f"{newest} is damaged: {shard}: ")
    assert f"checkpoint.resume={good}" in str(refused.value) and why in str(refused.value)
    with pytest.raises(CheckpointError) as refused:
        verified(_config(f"checkpoint.resume={newest}"), tmp_path / "run", newest)
    assert str(refused.value).startswith(
        f"checkpoint.resume={newest}: {newest} is damaged: {shard}: "
    ), str(refused.value)
    assert str(refused.value).endswith(
        f"the newest checkpoint beside it that verifies is "
        f"{good}: resume it with checkpoint.resume={good}"
    )


def test_a_damaged_checkpoint_is_verified_and_refused_outside_training(
    megatron_world, tmp_path: Path, capsys
):
    """``t2train ckpt verify`` and the loads of export, generate and eval (``load_model``) see a
    shard overwritten in place at its own size, which would otherwise load without an error
    (``checkpoint.init_from``: tests/test_hf_import.py)."""
    from t2train.checkpoint.errors import CheckpointError
    from t2train.cli import main
    from t2train.engine.megatron.checkpoint import save_checkpoint
    from t2train.export.load import load_model, open_checkpoint

    config = _config("model.residual=ddl")
    path = save_checkpoint(
        tmp_path,
        1,
        _objects(seed=1, config=config),
        {"config": asdict(config), "config_format": CONFIG_FORMAT},
    )
    assert main(["ckpt", "verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    files = len(list(path.iterdir())) - 1  # all but the checksums file itself
    assert f"its newest complete checkpoint is {path}" in out
    assert f"{path}: intact, {files} files (" in out and "match the xxh3_64 checksums" in out
    assert load_model(open_checkpoint(path), device="cpu").model is not None

    shard = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    _damage(shard, "overwritten")
    assert main(["ckpt", "verify", str(path)]) == 1
    assert capsys.readouterr().out.strip() == (
        f"{path} is damaged: {shard}: content differs from the xxh3_64 checksum recorded when "
        "it was saved (overwritten or corrupted in place)"
    )
    with pytest.raises(CheckpointError, match=f"^{path} is damaged: {shard}: content differs"):
        load_model(open_checkpoint(path), device="cpu")

    (path / "t2train_checksums.json").unlink()  # lost: its train state says it had one
    assert main(["ckpt", "verify", str(path)]) == 1
    assert capsys.readouterr().out.strip() == (
        f"{path} is damaged: {path / 't2train_checksums.json'}: missing (the checkpoint was "
        "saved with xxh3_64 checksums: the manifest was deleted or lost)"
    )

    from t2train.checkpoint import store
    from t2train.engine.megatron import checkpoint

    with pytest.MonkeyPatch.context() as older:  # as a t2train before checksums saved it
        older.setattr(checkpoint, "recorded_checksums", dict)
        older.setattr(store, "record_checksums", lambda directory: None)
        old = save_checkpoint(
            tmp_path / "old",
            1,
            _objects(seed=1, config=config),
            {"config": asdict(config), "config_format": CONFIG_FORMAT},
        )
    assert main(["ckpt", "verify", str(old)]) == 0
    assert "no checksums recorded (saved by an older t2train)" in capsys.readouterr().out
    assert load_model(open_checkpoint(old), device="cpu").model is not None


@pytest.mark.parametrize("where", ["parameter", "optimizer moment"])
def test_a_non_finite_state_is_never_published(megatron_world, tmp_path: Path, where):
    """NaN in a weight or in an Adam moment: the save fails on every rank like a failed write
    (``checkpoint.on_save_error=stop``: exit code 3); the previous checkpoint stays `latest`."""
    from t2train.checkpoint.manager import Checkpointer
    from t2train.errors import TrainingHalted

    config = _config()
    engine = _engine(seed=1, config=config)
    _steps(engine.objs, 1, seed=0)
    saver = Checkpointer(tmp_path, config, engine, lambda *args: None)
    first = saver.save(1, {})
    weight = next(engine.objs.model[0].module.parameters())
    if where == "parameter":
        poisoned = weight.data
    else:
        poisoned = engine.objs.optimizer.optimizer.state[
            engine.objs.optimizer.optimizer.param_groups[0]["params"][0]
        ]["exp_avg_sq"]
    poisoned.view(-1)[3] = float("nan")
    with pytest.raises(TrainingHalted) as err:
        saver.save(2, {})
    assert "NonFiniteState: 1 tensor(s) of the parameters and optimizer state hold NaN" in str(
        err.value
    ) and f"the last good checkpoint {first} is intact" in str(err.value)
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
