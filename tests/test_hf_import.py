"""``t2train import hf``: a Hugging Face Llama made here becomes a t2train checkpoint with the
same logits, a fresh run starts from its weights (``checkpoint.init_from``), and the export
of that run gives the Llama's weights back."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from t2train.cli import main
from t2train.errors import UserInputError

transformers = pytest.importorskip("transformers")


def _small_llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        )
    ).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, param in llama.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return llama


@pytest.mark.slow
def test_a_llama_round_trips_through_import_training_and_export(
    megatron_world, shakespeare, tmp_path, capsys
):
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from t2train.export.hf import export_hf
    from t2train.export.load import load_model, open_checkpoint

    vocab = Tokenizer.from_file(str(shakespeare / "tokenizer.json")).get_vocab_size()
    llama = _small_llama(vocab)
    folder, out = tmp_path / "llama", tmp_path / "imported"
    llama.save_pretrained(folder)
    shutil.copy(shakespeare / "tokenizer.json", folder)  # a tokenizer from a local folder
    assert main(["import", "hf", str(folder), str(out)]) == 0
    printed, stages = capsys.readouterr()
    assert stages.startswith(f"import hf [0:00]: reading the weights of {folder}\n")
    assert "import hf [0:" in stages.splitlines()[-1] and "saving them as the checkpoint" in stages
    assert f"t2train train --config {out / 't2train.yaml'} data.path=DATA" in printed

    tokens = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = load_model(open_checkpoint(out), device="cpu").model(
            tokens, torch.arange(48).unsqueeze(0), None
        )[..., :vocab]
        theirs = llama(tokens).logits
    assert (ours - theirs).abs().max() < 1e-5

    # Continued pretraining: one step at a negligible learning rate leaves the weights.
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--config",
                str(out / "t2train.yaml"),
                f"data.path={shakespeare}",
                "train.steps=1",
                "train.lr=1e-12",
                "train.min_lr=0",
                "train.warmup_steps=0",
                "train.micro_batch_size=2",
                "train.global_batch_size=2",
                "train.eval_batches=1",
                "log.diagnostics_interval=0",
                f"log.run_dir={run}",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"fresh start from the weights of {out / 'checkpoints' / 'step_00000000'}" in printed
    assert printed.splitlines()[-1] == (  # what to do with a finished run
        f"next: t2train generate {run} --prompt TEXT | t2train eval {run} --data {shakespeare} | "
        f"t2train export hf {run} OUT | tensorboard --logdir {tmp_path}"
    )
    # A damaged starting point is refused before the run writes anything.
    shard = max(
        (out / "checkpoints" / "step_00000000").glob("*.distcp"), key=lambda p: p.stat().st_size
    )
    shard.write_bytes(shard.read_bytes()[::-1])
    assert (
        main(
            [
                "train",
                "--config",
                str(out / "t2train.yaml"),
                f"data.path={shakespeare}",
                f"log.run_dir={tmp_path / 'run2'}",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == (
        f"error: checkpoint.init_from={out}: "
        f"{out / 'checkpoints' / 'step_00000000'} is damaged: {shard}: content differs from the "
        "xxh3_64 checksum recorded when it was saved (overwritten or corrupted in place); "
        "restore a copy, or use an earlier checkpoint of its run (`t2train ckpt verify` checks "
        "one)"
    )
    assert not (tmp_path / "run2").exists()

    umask = os.umask(0o022)
    try:
        export_hf(run, tmp_path / "back")
    finally:
        os.umask(umask)
    assert {oct(f.stat().st_mode & 0o777) for f in (tmp_path / "back").iterdir()} == {"0o644"}
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    for name, tensor in llama.state_dict().items():
        assert torch.allclose(back[name], tensor, atol=1e-6), name


@pytest.mark.slow
def test_the_import_train_export_sequence_works_from_other_directories(
    megatron_world, shakespeare, tmp_path, monkeypatch, capsys
):
    """docs/export.md's import sequence with relative paths, each command in another
    directory: `import hf` into a relative OUT, `train --config OUT/t2train.yaml` from
    elsewhere with a relative data.path (its --dry-run names the weights it would start from,
    verified), then `export hf` of the run from a third directory, which finds the run's
    tokenizer by the data.path the run recorded."""
    from tokenizers import Tokenizer

    for name in ("a", "b", "c/d"):  # c/d: a relative data.path from b leads elsewhere there
        (tmp_path / name).mkdir(parents=True)
    vocab = Tokenizer.from_file(str(shakespeare / "tokenizer.json")).get_vocab_size()
    _small_llama(vocab).save_pretrained(tmp_path / "llama")
    shutil.copy(shakespeare / "tokenizer.json", tmp_path / "llama")
    monkeypatch.chdir(tmp_path / "a")
    assert main(["import", "hf", "../llama", "imported"]) == 0
    monkeypatch.chdir(tmp_path / "b")
    data = os.path.relpath(shakespeare, tmp_path / "b")
    train = [
        "train",
        "--config",
        "../a/imported/t2train.yaml",
        f"data.path={data}",
        "train.steps=1",
        "train.warmup_steps=0",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "train.eval_batches=1",
        "log.diagnostics_interval=0",
        "log.run_dir=run",
    ]
    capsys.readouterr()
    assert main([*train, "--dry-run"]) == 0
    weights = tmp_path / "a" / "imported" / "checkpoints" / "step_00000000"
    assert (
        f"fresh start from the weights of {weights} (verified, not loaded now)"
        in capsys.readouterr().out
    )
    # Another model is refused by the dry run, as the run would refuse it: before a job starts
    different = "written by a different model; model.num_layers: checkpoint 2, this run 3"
    assert main([*train, "model.num_layers=3", "--dry-run"]) == 2
    assert f"error: {weights}: {different}" in capsys.readouterr().err
    assert main(train) == 0
    assert main([*train, "model.num_layers=3", "--dry-run"]) == 2  # now it would resume
    assert capsys.readouterr().err == f"error: run/checkpoints/step_00000001: {different}\n"
    monkeypatch.chdir(tmp_path / "c" / "d")
    assert main(["export", "hf", "../../b/run", "hf"]) == 0
    assert (tmp_path / "c" / "d" / "hf" / "model.safetensors").is_file()
    assert (tmp_path / "c" / "d" / "hf" / "tokenizer.json").is_file()


def _family_model(family: str, vocab: int):
    """A small model of a Llama family made here: Llama with Llama 3.1's RoPE scaling (a
    long rope_theta, so the scaled frequencies matter at these positions), Mistral, Qwen2
    (q, k, v biases) or Qwen3 (q/k norms, heads of 32 where hidden / heads is 16), norms and
    biases away from their initial values."""
    import transformers

    shape = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    config = {
        "llama3": lambda: transformers.LlamaConfig(
            **shape,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        "mistral": lambda: transformers.MistralConfig(
            **shape, sliding_window=None, rope_theta=10000.0
        ),
        "qwen2": lambda: transformers.Qwen2Config(
            **shape, rope_theta=10000.0, use_sliding_window=False
        ),
        "qwen3": lambda: transformers.Qwen3Config(
            **shape, head_dim=32, rope_theta=10000.0, use_sliding_window=False
        ),
    }[family]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.5)
    return model


def _greedy(logits_of, tokens: torch.Tensor, steps: int) -> list[int]:
    for _ in range(steps):
        tokens = torch.cat([tokens, logits_of(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0].tolist()


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, architecture",
    [
        ("llama3", "LlamaForCausalLM"),
        ("mistral", "MistralForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
    ],
)
def test_each_llama_family_imports_trains_and_exports_back(
    megatron_world, shakespeare, tmp_path, capsys, family, architecture
):
    """A transformers model of the family with random weights: after `import hf` the logits
    equal transformers' (fp32, 1e-5) and 12 greedy tokens are the same; a run from it trains
    5 steps and exports as the same class, whose logits equal the run's model's."""
    from tokenizers import Tokenizer

    from t2train.export.load import load_model, open_checkpoint

    vocab = Tokenizer.from_file(str(shakespeare / "tokenizer.json")).get_vocab_size()
    theirs = _family_model(family, vocab)
    theirs.save_pretrained(tmp_path / "hf")
    shutil.copy(shakespeare / "tokenizer.json", tmp_path / "hf")
    assert main(["import", "hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0

    tokens = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(64).unsqueeze(0)

    def logits(model):
        return lambda ids: model(ids, positions[:, : ids.shape[1]], None)[..., :vocab]

    ours = load_model(open_checkpoint(tmp_path / "imported"), device="cpu").model
    with torch.no_grad():
        torch.testing.assert_close(
            logits(ours)(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5
        )
        assert _greedy(logits(ours), tokens[:1, :8], 12) == _greedy(
            lambda ids: theirs(ids).logits, tokens[:1, :8], 12
        )

    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--config",
                str(tmp_path / "imported" / "t2train.yaml"),
                f"data.path={shakespeare}",
                "train.steps=5",
                "train.lr=1e-3",
                "train.warmup_steps=0",
                "train.micro_batch_size=2",
                "train.global_batch_size=2",
                "train.eval_batches=1",
                "log.diagnostics_interval=0",
                f"log.run_dir={run}",
            ]
        )
        == 0
    )
    assert main(["export", "hf", str(run), str(tmp_path / "back")]) == 0
    capsys.readouterr()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == architecture
    trained = load_model(open_checkpoint(run), device="cpu").model
    with torch.no_grad():
        torch.testing.assert_close(
            back(tokens).logits, logits(trained)(tokens), rtol=1e-5, atol=1e-5
        )
        assert not torch.allclose(back(tokens).logits, theirs(tokens).logits)  # it trained


def test_what_the_standard_design_cannot_run_is_refused(tmp_path):
    from t2train.export.hf_import import hf_model_section

    def refused(config: dict, match: str) -> None:
        with pytest.raises(UserInputError, match=match):
            hf_model_section(
                {"num_attention_heads": 4, "hidden_size": 64, **config},
                tmp_path / "config.json",
                None,
            )

    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    refused(
        {
            "architectures": ["LlamaForCausalLM"],
            "rope_scaling": {**llama3, "high_freq_factor": 2.0},
        },
        "rope_scaling=.*is not supported \\(Llama 3.1's rope_type 'llama3'",
    )
    refused(
        {
            "architectures": ["LlamaForCausalLM"],
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
        },
        "rope_scaling=.*is not supported",
    )
    refused(
        {"architectures": ["LlamaForCausalLM"], "attention_bias": True},
        "attention_bias=True is not supported",
    )
    refused(
        {"architectures": ["MistralForCausalLM"], "sliding_window": 4096},
        "sliding_window=4096 is not supported",
    )
    refused(
        {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True},
        "use_sliding_window=True is not supported",
    )
    refused(
        {"architectures": ["GPT2LMHeadModel"]},
        "only LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM checkpoints",
    )
