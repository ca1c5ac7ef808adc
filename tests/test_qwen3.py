"""Qwen3 and heads wider than hidden_size / num_attention_heads, in-process.

* A two-layer Qwen3 (grouped-query attention, head_dim 32 where hidden / heads is 16, every
  norm, q_norm and k_norm included, U(0.5, 1.5)) made here with random weights and brought in
  by ``import_hf`` gives transformers' logits (fp32, 1e-5; on the CPU they come out bitwise
  equal, as do the Llama's, the Qwen2's and the modeling file's whole-sequence logits below)
  and greedy tokens; with its q/k norms reset to 1 transformers' logits move far outside that
  tolerance, so the comparison sees them. Exported again (``export_hf``) it is a
  ``Qwen3ForCausalLM`` whose config.json equals the original in every field and whose weights
  are the original's exactly.
* A Llama and a Qwen2 with head_dim 32 (hidden / heads 16) do the same through import and
  export.
* A non-standard design with ``model.qk_norm`` and ``model.head_dim`` computes through the
  exported modeling file what the trainer computes (fp32, 1e-5), also token by token through
  its KV cache, and has the parameters ``t2train.model.flops`` counts.
* Impossible combinations are refused in one line naming the field.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict

import pytest
import torch
from test_export import _hf_model, _t2train_model, _tokens
from test_fast_families import VOCAB, _hf_folder, _off_init

from t2train.checkpoint.errors import CheckpointError
from t2train.config.loader import load_config
from t2train.errors import ConfigError, UserInputError

transformers = pytest.importorskip("transformers")

# Wider heads than hidden_size / num_attention_heads (64 / 4), as Qwen3-0.6B's (1024 / 16, 128).
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=0,  # the tokenizer's end-of-document token, which the export writes
    eos_token_id=0,
)
FAMILIES = {
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, num_hidden_layers=2),
    "llama": lambda: transformers.LlamaConfig(**SHAPE, num_hidden_layers=1),
    "qwen2": lambda: transformers.Qwen2Config(
        **SHAPE, num_hidden_layers=1, use_sliding_window=False
    ),
}
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _imported(family: str, tmp_path):
    """The family's model with random weights (norms and biases off their init), its folder
    and ``import_hf``'s result."""
    from t2train.export.hf_import import import_hf

    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    _off_init(theirs)
    folder = _hf_folder(theirs, tmp_path / family)
    return theirs, folder, import_hf(folder, tmp_path / "imported")


def _logits(model):
    """t2train's logits of the first VOCAB rows, as a function of the tokens."""
    return lambda ids: model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)[..., :VOCAB]


def _greedy(logits_of, tokens: torch.Tensor, steps: int) -> list[int]:
    for _ in range(steps):
        tokens = torch.cat([tokens, logits_of(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0].tolist()


def _exported_back(theirs, folder, imported, tmp_path) -> dict:
    """``export_hf`` of the import: its config.json and weights are the original's."""
    from safetensors.torch import load_file

    from t2train.export.hf import export_hf

    export_hf(imported.out, tmp_path / "back", tokenizer=imported.out / "tokenizer.json")
    original = json.loads((folder / "config.json").read_text())
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    differing = {
        field: (original.get(field), exported.get(field))
        for field in set(original) | set(exported)
        if original.get(field, KeyError) != exported.get(field, KeyError)
    }
    assert not differing, f"field: (original, exported): {differing}"
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == theirs.state_dict().keys()
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(back[name], tensor), name
    return exported


def test_a_qwen3_imports_with_transformers_logits_and_exports_back(megatron_world, tmp_path):
    """Qwen3 (2 layers, 4 query heads over 2 key/value groups, head_dim 32 != 64 / 4) through
    ``import_hf``: Megatron's q/k layernorm and kv_channels carry it; logits equal
    transformers' to 1e-5 (fp32; they come out bitwise equal) and 8 greedy tokens are the
    same; the q/k norms matter at that tolerance. ``export_hf`` gives the Qwen3 back: the
    same class, config.json equal in every field, weights exact."""
    from t2train.export.load import load_model, open_checkpoint

    qwen, folder, imported = _imported("qwen3", tmp_path)
    assert imported.parameters == sum(p.numel() for p in qwen.parameters())
    ours = load_model(open_checkpoint(imported.out), device="cpu").model
    assert ours.config.qk_layernorm and ours.config.kv_channels == 32
    assert not ours.config.add_qkv_bias

    tokens = _tokens(VOCAB, batch=3, seq=16)
    with torch.no_grad():
        theirs = qwen(tokens).logits
        torch.testing.assert_close(_logits(ours)(tokens), theirs, **TOLERANCE)
        assert _greedy(_logits(ours), tokens[:1, :8], 8) == _greedy(
            lambda ids: qwen(ids).logits, tokens[:1, :8], 8
        )
        without_norms = copy.deepcopy(qwen)
        for layer in without_norms.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
        assert (without_norms(tokens).logits - theirs).abs().max() > 100 * 1e-5

    exported = _exported_back(qwen, folder, imported, tmp_path)
    assert exported["architectures"] == ["Qwen3ForCausalLM"] and exported["head_dim"] == 32
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == "Qwen3ForCausalLM"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_wider_heads_of_llama_and_qwen2_import_and_export_back(megatron_world, tmp_path, family):
    """A Llama and a Qwen2 (q/k/v biases) with head_dim 32 != 64 / 4 (``model.head_dim``):
    logits equal transformers' to 1e-5 after ``import_hf``; ``export_hf`` gives config.json
    back field by field and the weights exactly."""
    from t2train.export.load import load_model, open_checkpoint

    theirs, folder, imported = _imported(family, tmp_path)
    ours = load_model(open_checkpoint(imported.out), device="cpu").model
    assert ours.config.kv_channels == 32 and not ours.config.qk_layernorm
    tokens = _tokens(VOCAB, batch=2, seq=16)
    with torch.no_grad():
        torch.testing.assert_close(_logits(ours)(tokens), theirs(tokens).logits, **TOLERANCE)
    assert _exported_back(theirs, folder, imported, tmp_path)["head_dim"] == 32


QK_NORM = ["model.qk_norm=true", "model.head_dim=32", "model.num_layers=2"]


@pytest.mark.parametrize(
    "variant",
    [["model.residual=hc"], ["model.shortswa.window=4", "model.num_query_groups=2"]],
    ids=["hc", "standard+mixer_gqa"],
)
def test_the_modeling_file_computes_q_k_norms_and_wider_heads_as_the_trainer(
    megatron_world, variant
):
    """``model.qk_norm`` with ``model.head_dim=32`` (64 / 4 = 16) in a design that exports
    through the modeling file (HC's streams; the standard design with the local mixer, whose
    attention has the wider heads but no q/k norms): its logits equal the trainer's to 1e-5
    (fp32, random weights), also fed 10 tokens and then one at a time through its KV cache,
    and the model has the parameters ``flops.parameters`` counts."""
    from transformers import DynamicCache

    from t2train.export.hf import hf_state_dict
    from t2train.model.flops import parameters

    config, model = _t2train_model(QK_NORM + variant)
    assert sum(p.numel() for p in model.parameters()) == parameters(config.model, 128)
    state = hf_state_dict(model.state_dict(), config.model)
    assert state["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert not any("local_attn.q_norm" in name for name in state)
    hf = _hf_model(config.model, state)
    assert type(hf).__name__ == "T2TrainForCausalLM"
    tokens = _tokens()
    with torch.no_grad():
        ours = model(tokens, torch.arange(16).expand(2, 16), None)
        torch.testing.assert_close(hf(tokens).logits, ours, **TOLERANCE)
        cache = DynamicCache()
        steps = [hf(tokens[:, :10], past_key_values=cache, use_cache=True).logits]
        steps += [
            hf(tokens[:, i : i + 1], past_key_values=cache, use_cache=True).logits
            for i in range(10, 16)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), ours, **TOLERANCE)


def _one_line(error: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(error.value)
    return str(error.value)


def test_impossible_combinations_are_refused_in_one_line(tmp_path):
    """An odd head_dim (RoPE rotates pairs), q/k norms under DeepSpeed with tensor parallelism
    (their gradients differ per rank), a Qwen3 with ``attention_bias`` (it biases o_proj too),
    q/k norms exported as another family or a Qwen3 without them, and a checkpoint without
    q/k norms continuing a run with them: each refused in one line naming the field. A
    head_dim given as hidden / heads is the same model as none."""
    from t2train.checkpoint.compatibility import check_same_model
    from t2train.export.hf import hf_config
    from t2train.export.hf_import import hf_model_section

    with pytest.raises(ConfigError) as odd:
        load_config(overrides=["model.head_dim=15"])
    assert _one_line(odd).startswith("model.head_dim=15: must be even")
    with pytest.raises(ConfigError) as deepspeed:
        load_config(overrides=["model.qk_norm=true", "train.engine=deepspeed", "parallel.tensor=2"])
    assert _one_line(deepspeed).startswith("model.qk_norm=True: with parallel.tensor=2")

    qwen3 = {**FAMILIES["qwen3"]().to_dict(), "architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(UserInputError) as bias:
        hf_model_section({**qwen3, "attention_bias": True}, tmp_path / "config.json", None)
    assert "attention_bias=True is not supported" in _one_line(bias)

    def exported(*overrides: str):
        model = load_config(overrides=["model.vocab_size=128", *overrides]).model
        with pytest.raises(UserInputError) as refused:
            hf_config(model, 128, eos_id=0, dtype=torch.float32)
        return _one_line(refused)

    assert exported("model.qk_norm=true", "model.hf_architecture=MistralForCausalLM").startswith(
        "model.qk_norm=True cannot be exported as MistralForCausalLM (Qwen3ForCausalLM has q "
        "and k norms"
    )
    assert exported("model.hf_architecture=Qwen3ForCausalLM").startswith(
        "model.qk_norm=False cannot be exported as Qwen3ForCausalLM"
    )

    saved = load_config(overrides=["model.head_dim=64", "model.vocab_size=128"]).model
    written = {"config": {"model": asdict(saved)}, "config_format": 2}
    same = load_config(overrides=["model.vocab_size=128"]).model  # 256 / 4 = 64
    check_same_model(tmp_path, written, same)
    with pytest.raises(CheckpointError) as norms:
        check_same_model(tmp_path, written, load_config(overrides=["model.qk_norm=true"]).model)
    assert "model.qk_norm: checkpoint False, this run True" in _one_line(norms)
