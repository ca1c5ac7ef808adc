"""Checkpoints in and out: ``t2train ckpt convert`` writes a checkpoint's model weights as one
plain state dict (torch or safetensors) under t2train's names, equal to the checkpoint's;
``checkpoint.init_from`` starts a model from such a file with those weights exactly, and
refuses one that does not fit the model in one line naming the key or shape and the config
field; ``t2train import hf ORG/NAME`` reads a Hub id from huggingface_hub's cache offline, and
refuses one not in it in one line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch

from t2train.checkpoint.errors import CheckpointError
from t2train.cli import main
from t2train.config.loader import load_config
from t2train.config.schema import CONFIG_FORMAT

VOCAB = 128  # the run's vocabulary: a multiple of make_vocab_size_divisible_by, no padding
SHA = "ab" * 32  # the tokenizer hash the checkpoint records (the run's data is not needed)


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


def _weights(module) -> dict[str, torch.Tensor]:
    return {
        name: tensor.detach().clone()
        for name, tensor in module.state_dict().items()
        if not name.endswith("_extra_state")
    }


@dataclass
class Trained:
    checkpoint: Path
    weights: dict[str, torch.Tensor]  # the model's state when it was saved


@pytest.fixture(scope="module")
def trained(megatron_world, tmp_path_factory) -> Trained:
    """A two-layer tiny model after one training step (weights away from their
    initialisation), saved by the Megatron engine at step 1."""
    from t2train.engine.megatron import MegatronEngine
    from t2train.engine.megatron.checkpoint import save_checkpoint
    from t2train.engine.megatron.step import train_step
    from t2train.parallel.init import set_seed

    config = _config()
    set_seed(1, megatron_world)
    objs = MegatronEngine(config, vocab_size=VOCAB).objs
    tokens = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(0))
    train_step(objs, [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tokens.split(2)])
    path = save_checkpoint(
        tmp_path_factory.mktemp("run"),
        1,
        objs,
        {"config": asdict(config), "config_format": CONFIG_FORMAT, "tokenizer_sha256": SHA},
    )
    return Trained(path, _weights(objs.model[0].module))


@pytest.fixture(scope="module")
def converted(trained, tmp_path_factory) -> dict[str, Path]:
    """``t2train ckpt convert`` of the checkpoint in each format: format -> OUT."""
    root = tmp_path_factory.mktemp("converted")
    for format in ("torch", "safetensors"):
        args = ["ckpt", "convert", str(trained.checkpoint), str(root / format)]
        assert main([*args, "--format", format]) == 0
    return {format: root / format for format in ("torch", "safetensors")}


def test_convert_writes_the_checkpoints_weights_under_t2trains_names(trained, converted, capsys):
    from safetensors.torch import load_file

    read = {
        "torch": lambda out: torch.load(out / "model.pt", weights_only=True),
        "safetensors": lambda out: load_file(str(out / "model.safetensors")),
    }
    for format, out in converted.items():
        state = read[format](out)
        assert sorted(state) == sorted(trained.weights)  # the model's own names
        assert "decoder.layers.1.self_attention.linear_qkv.weight" in state
        for name, tensor in trained.weights.items():
            assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
        record = json.loads((out / "t2train_weights.json").read_text())
        assert record["weights"] == f"model.{'pt' if format == 'torch' else 'safetensors'}"
        assert (record["format"], record["step"], record["tokenizer_sha256"]) == (format, 1, SHA)
        assert record["checkpoint"] == str(trained.checkpoint.resolve())
        assert record["parameters"] == sum(t.numel() for t in trained.weights.values())
        # the run's config beside it, a config file like any other
        assert load_config(config_file=str(out / "t2train.yaml")) == _config()
        assert main(["ckpt", "verify", str(out)]) == 0
        assert capsys.readouterr().out.startswith(f"{out}: intact, 3 files (")
        assert not out.with_name(out.name + ".tmp").exists()

    # The printed summary, of a third conversion
    out = converted["torch"].parent / "again"
    assert main(["ckpt", "convert", str(trained.checkpoint.parent), str(out)]) == 0
    printed, stages = capsys.readouterr()
    parameters = sum(t.numel() for t in trained.weights.values())
    assert printed.splitlines() == [
        f"converted {parameters / 1e6:.2f}M parameters of {trained.checkpoint} to "
        f"{out} (model.pt, t2train.yaml, t2train_checksums.json, t2train_weights.json)",
        f"start a run from them: t2train train ... checkpoint.init_from={out}",
    ]
    assert stages.startswith(f"ckpt convert [0:00]: loading the weights of {trained.checkpoint}")


def test_convert_refuses_in_one_line_and_writes_nothing(trained, tmp_path, capsys, monkeypatch):
    import t2train.export.state_dict as state_dict

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    cases = {
        (str(trained.checkpoint), str(tmp_path / "full")): (
            f"error: output directory {tmp_path / 'full'} is not empty; choose another one or "
            "pass --overwrite to replace it"
        ),
        (str(tmp_path / "nothing"), str(tmp_path / "out")): (
            f"error: {tmp_path / 'nothing'}: not a complete t2train checkpoint, nor a run or "
            "checkpoints directory holding one"
        ),
    }
    for (given, out), error in cases.items():
        assert main(["ckpt", "convert", given, out]) == 2
        assert capsys.readouterr().err.splitlines() == [error]
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"

    def full_disk(state, file):
        raise CheckpointError(f"{file}: No space left on device")

    monkeypatch.setattr(state_dict, "write_weights_file", full_disk)
    assert main(["ckpt", "convert", str(trained.checkpoint), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.splitlines()[-1]  # after the stage lines
    assert error == f"error: {tmp_path / 'out.tmp' / 'model.pt'}: No space left on device"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no OUT, no OUT.tmp


def test_a_run_starts_from_a_converted_file_with_its_weights_exactly(
    megatron_world, trained, converted
):
    """The engine a run builds from ``checkpoint.init_from`` (the folder, or the file in it):
    its parameters are the checkpoint's exactly."""
    from t2train.engine.megatron import MegatronEngine
    from t2train.parallel.init import set_seed
    from t2train.train.trainer import weights_to_start_from

    facts = {"tokenizer_sha256": SHA, "vocab_size": VOCAB}
    for given in (converted["torch"], converted["safetensors"] / "model.safetensors"):
        config = _config(f"checkpoint.init_from={given}")
        start = weights_to_start_from(config, facts)
        assert start is not None and start.path.name.startswith("model.")
        set_seed(7, megatron_world)  # another initialisation than the source's
        engine = MegatronEngine(config, VOCAB, start)
        loaded = _weights(engine.objs.model[0].module)
        assert list(loaded) == list(trained.weights)
        for name, tensor in trained.weights.items():
            assert torch.equal(loaded[name], tensor), name


EMBEDDING = "embedding.word_embeddings.weight"


@pytest.mark.slow
def test_runs_at_other_layouts_start_from_a_converted_file(
    megatron_world, trained, converted, tmp_path
):
    """Two ranks start from the file at TP = 2 (its vocabulary padded to 256 rows) and at
    PP = 2 (tied embeddings: the last stage's output layer from the embedding), and save: each
    checkpoint, read back at TP = PP = 1, holds the file's weights exactly (the added padding
    rows zero)."""
    from t2train.export.load import load_model, open_checkpoint

    from torchrun_helper import run_torchrun

    saved = run_torchrun(
        "start_from_weights.py",
        2,
        [
            "--weights",
            str(converted["safetensors"] / "model.safetensors"),
            "--scratch",
            str(tmp_path),
            "--layouts",
            "2x1,1x2",
        ],
        tmp_path / "result.json",
    )
    assert sorted(saved) == ["1x2", "2x1"]
    for layout, path in saved.items():
        loaded = _weights(load_model(open_checkpoint(path), device="cpu").model)
        assert sorted(loaded) == sorted(trained.weights), layout
        for name, tensor in trained.weights.items():
            rows = tensor.shape[0]
            assert torch.equal(loaded[name][:rows], tensor), (layout, name)
            assert not loaded[name][rows:].any(), (layout, name)
        assert loaded[EMBEDDING].shape[0] == {"2x1": 256, "1x2": 128}[layout]


def test_a_file_that_does_not_fit_the_model_is_refused_naming_the_field(
    megatron_world, trained, converted, tmp_path
):
    """Alone, a file's tensors are checked against the model when they are read (naming the
    first key or shape that differs and the field that likely does); in its folder, the config
    and tokenizer recorded beside it are checked first, as a checkpoint's are."""
    from t2train.engine.start_weights import StartWeights
    from t2train.export.load import build_model
    from t2train.train.trainer import weights_to_start_from

    alone = tmp_path / "weights.pt"
    shutil.copy(converted["torch"] / "model.pt", alone)
    vocab_rows = {"model.vocab_size=200": 256}  # padded to a multiple of 128
    refusals = {
        "model.num_layers=3": "it holds 2 layers, this run's model 3; model.num_layers likely "
        "differs",
        "model.hidden_size=128": f"{EMBEDDING} is [128, 192] there, [128, 128] here; "
        "model.hidden_size likely differs",
        "model.ffn_hidden_size=256": "decoder.layers.0.mlp.linear_fc1.weight is [1024, 192] "
        "there, [512, 192] here; model.ffn_hidden_size likely differs",
        "model.num_query_groups=2": "decoder.layers.0.self_attention.linear_qkv.weight is "
        "[576, 192] there, [384, 192] here; model.num_attention_heads, "
        "model.num_query_groups or model.head_dim likely differs",
        "model.tie_embeddings=false": "it lacks output_layer.weight; model.tie_embeddings "
        "likely differs",
        "model.vocab_size=200": f"{EMBEDDING} is [128, 192] there, [256, 192] here; "
        "model.vocab_size (this run's vocabulary has 200 tokens) likely differs",
    }
    for override, why in refusals.items():
        config = _config(override)
        vocab = config.model.vocab_size or VOCAB
        chunk = build_model(config, vocab_rows.get(override, VOCAB), torch.float32)
        with pytest.raises(CheckpointError) as refused:
            StartWeights(alone, SHA, vocab).load_into([chunk], config)
        assert str(refused.value) == f"{alone}: does not fit this run's model: {why}"

    # In its folder: the recorded config and tokenizer, as for a checkpoint (also --dry-run)
    folder = converted["torch"]
    config = _config("model.num_layers=3", f"checkpoint.init_from={folder}")
    start = weights_to_start_from(config, {"tokenizer_sha256": SHA, "vocab_size": VOCAB})
    with pytest.raises(CheckpointError) as refused:
        start.check(config)
    assert str(refused.value) == (
        f"{folder / 'model.pt'}: written by a different model; model.num_layers: "
        "checkpoint 2, this run 3"
    )
    with pytest.raises(CheckpointError, match="trained with tokenizer abababababab, but"):
        StartWeights(folder / "model.pt", "cd" * 32, VOCAB).check(_config())

    # Not a state dict; a damaged file of a folder with checksums; a path leading nowhere
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError) as refused:
        StartWeights(tmp_path / "list.pt", SHA, VOCAB).load_into([chunk], _config())
    assert str(refused.value) == (
        f"{tmp_path / 'list.pt'}: not a plain state dict (expected a mapping of parameter "
        "names to tensors, as `t2train ckpt convert` writes)"
    )
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    data = bytearray((damaged / "model.pt").read_bytes())
    data[-100] ^= 0xFF
    (damaged / "model.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as refused:
        StartWeights.named(str(damaged), SHA, VOCAB)
    assert str(refused.value).startswith(
        f"checkpoint.init_from={damaged}: {damaged} is damaged: {damaged / 'model.pt'}: "
        "content differs from the xxh3_64 checksum"
    )
    with pytest.raises(CheckpointError) as refused:
        StartWeights.named(str(tmp_path / "nowhere"), SHA, VOCAB)
    assert str(refused.value) == (
        f"checkpoint.init_from={tmp_path / 'nowhere'}: {tmp_path / 'nowhere'}: not a complete "
        "t2train checkpoint, nor a run or checkpoints directory holding one, nor a weights "
        "file (.pt or .safetensors, as `t2train ckpt convert` writes) or its folder"
    )


# --- import hf from a Hub id -----------------------------------------------------------------

REPO = "t2train-tests/tiny-llama"


def _cache_as_hub_download(folder: Path, hub: Path, repo: str) -> str:
    """``folder`` laid out as huggingface_hub caches a download of ``repo``: each file a blob
    named by its hash, linked (relative) from ``snapshots/<commit>/``, and ``refs/main``
    naming the commit. Returns the commit."""
    from huggingface_hub.file_download import repo_folder_name

    storage = hub / repo_folder_name(repo_id=repo, repo_type="model")
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir()
    for file in folder.iterdir():
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, storage / "blobs" / blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    return commit


def _t2train(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The CLI in a process of its own: huggingface_hub reads HF_* when it is imported."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run(
        [sys.executable, "-m", "t2train.cli", *args],
        capture_output=True,
        text=True,
        env={**environment, **env},
        timeout=300,
    )


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> tuple[Path, str, dict]:
    """HF_HOME with a one-layer Llama (hidden 32, word-level tokenizer) in its Hub cache as
    ``REPO``: (HF_HOME, commit, the Llama's state dict)."""
    transformers = pytest.importorskip("transformers")
    from huggingface_hub import scan_cache_dir
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("hub")
    words = ["<|endoftext|>", "[UNK]", *"the a to of and in is it".split()]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=len(words),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=32,
        )
    )
    llama.save_pretrained(root / "llama")
    tokenizer.save(str(root / "llama" / "tokenizer.json"))
    home = root / "hf_home"
    commit = _cache_as_hub_download(root / "llama", home / "hub", REPO)
    # huggingface_hub itself sees the download
    (cached,) = scan_cache_dir(home / "hub").repos
    assert cached.repo_id == REPO and {r.commit_hash for r in cached.revisions} == {commit}
    return home, commit, llama.state_dict()


def test_import_hf_reads_a_hub_id_from_the_cache_offline(hub_cache, tmp_path):
    from safetensors.torch import load_file

    from t2train.checkpoint.train_state import read_train_state

    home, commit, llama = hub_cache
    out = tmp_path / "imported"
    done = _t2train("import", "hf", REPO, str(out), HF_HOME=str(home), HF_HUB_OFFLINE="1")
    assert done.returncode == 0, done.stderr
    assert f"M parameters of {REPO} as the standard design" in done.stdout
    snapshot = home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit
    assert f"reading the weights of {snapshot}" in done.stderr
    state = read_train_state(out / "checkpoints" / "step_00000000")
    assert state["imported_from"] == f"https://huggingface.co/{REPO}/tree/{commit}"
    assert (out / "tokenizer.json").is_file()
    # the weights read are the cached Llama's
    cached = load_file(str(snapshot / "model.safetensors"))
    assert torch.equal(cached["model.embed_tokens.weight"], llama["model.embed_tokens.weight"])


def test_a_hub_id_not_in_the_cache_is_refused_in_one_line(hub_cache, tmp_path):
    home, _, _ = hub_cache
    cache = home / "hub"
    out = tmp_path / "imported"
    absent = "t2train-tests/absent"
    done = _t2train("import", "hf", absent, str(out), HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"error: {absent}: no such folder; as a Hugging Face Hub id it is not in the cache "
        f"{cache} and HF_HUB_OFFLINE is set; download it where the Hub is reachable (`hf "
        f"download {absent}`, the same HF_HOME) or give a local folder"
    ]
    assert not out.exists()
