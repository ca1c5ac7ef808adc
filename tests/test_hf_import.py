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
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, param in llama.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return llama


@pytest.mark.slow
def test_a_llama_round_trips_through_import_training_and_export(megatron_world, shakespeare,
                                                                tmp_path, capsys):
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
            tokens, torch.arange(48).unsqueeze(0), None)[..., :vocab]
        theirs = llama(tokens).logits
    assert (ours - theirs).abs().max() < 1e-5

    # Continued pretraining: one step at a negligible learning rate leaves the weights.
    run = tmp_path / "run"
    assert main(["train", "--config", str(out / "t2train.yaml"), f"data.path={shakespeare}",
                 "train.steps=1", "train.lr=1e-12", "train.min_lr=0", "train.warmup_steps=0",
                 "train.micro_batch_size=2", "train.global_batch_size=2", "train.eval_batches=1",
                 "log.diagnostics_interval=0", f"log.run_dir={run}"]) == 0
    printed = capsys.readouterr().out
    assert f"fresh start from the weights of {out / 'checkpoints' / 'step_00000000'}" in printed
    assert printed.splitlines()[-1] == (  # what to do with a finished run
        f"next: t2train generate {run} --prompt TEXT | t2train eval {run} --data {shakespeare} | "
        f"t2train export hf {run} OUT | tensorboard --logdir {tmp_path}")
    # A damaged starting point is refused before the run writes anything.
    shard = max((out / "checkpoints" / "step_00000000").glob("*.distcp"),
                key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[::-1])
    assert main(["train", "--config", str(out / "t2train.yaml"), f"data.path={shakespeare}",
                 f"log.run_dir={tmp_path / 'run2'}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: checkpoint.init_from={out}: "
        f"{out / 'checkpoints' / 'step_00000000'} is damaged: {shard}: content differs from the "
        "xxh3_64 checksum recorded when it was saved (overwritten or corrupted in place); "
        "restore a copy, or use an earlier checkpoint of its run (`t2train ckpt verify` checks "
        "one)")
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


def test_what_the_standard_design_cannot_run_is_refused(tmp_path):
    from t2train.export.hf_import import llama_model_section

    config = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4,
              "hidden_size": 64, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(UserInputError, match="rope_scaling=.*is not supported"):
        llama_model_section(config, tmp_path / "config.json", None)
    with pytest.raises(UserInputError, match="only LlamaForCausalLM checkpoints"):
        llama_model_section({"architectures": ["GPT2LMHeadModel"]}, tmp_path, None)
