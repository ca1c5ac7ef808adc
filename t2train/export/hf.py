"""``t2train export hf CHECKPOINT OUT``: a Hugging Face model folder from any checkpoint.

OUT holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (or shards and
their index above ``max_shard_size``) and the run's tokenizer (``tokenizer.json``,
``tokenizer_config.json``). A plain pre-norm Transformer exports as ``LlamaForCausalLM``
(or the Mistral, Qwen2 or Qwen3 class it was imported as); every other residual design adds
``modeling_t2train.py`` (``trust_remote_code=True``).

Everything is written into ``OUT.tmp`` and renamed to OUT at the end, so a failed export
leaves no half-written OUT. Inputs are checked (checkpoint, design, tokenizer, OUT) before
any weight is read.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from t2train.errors import UserInputError
from t2train.export.folders import check_out, staged
from t2train.export.load import load_model, open_checkpoint
from t2train.export.tokenizer import RunTokenizer, run_tokenizer
from t2train.residual import hf as residual_hf

MODELING_NAME = "modeling_t2train"  # OUT/modeling_t2train.py, residual.hf.modeling_source()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Megatron layer submodule -> its Hugging Face name (Llama's where Llama has one).
_LAYER_SLOTS = {
    "input_layernorm": "input_layernorm",
    "self_attention": "self_attn",
    "pre_mlp_layernorm": "post_attention_layernorm",
    "mlp": "mlp",
    "pre_attention_layernorm": "local_attn_layernorm",
    "pre_attention": "local_attn",
    "pre_attention_residual": "local_attn_residual",
}
_ATTENTION_SLOTS = ("self_attention", "pre_attention")  # Megatron SelfAttention modules
_ATTENTION_NORMS = {"q_layernorm": "q_norm", "k_layernorm": "k_norm"}  # model.qk_norm's


@dataclass
class Export:
    out: Path
    architecture: str
    files: list[str]
    parameters: int


def export_hf(
    given: str | Path,
    out: str | Path,
    tokenizer: Optional[str | Path] = None,
    max_shard_size: str | int = "5GB",
    dtype: Optional[str] = None,
    overwrite: bool = False,
    progress: Callable[[str], None] = lambda stage: None,
) -> Export:
    """OUT from the checkpoint ``given`` leads to; ``progress`` hears each stage start."""
    out = Path(out)
    check_out(out, overwrite)
    checkpoint = open_checkpoint(given)
    model_config = checkpoint.config.model
    llama = residual_hf.is_llama(model_config)
    if not llama and model_config.residual not in residual_hf.modeling_designs():
        raise UserInputError(
            f"{checkpoint.path}: model.residual={model_config.residual!r} has "
            "no Hugging Face modeling code yet (no export part "
            "t2train/residual/<design>/hf.py; the modeling file implements "
            + ", ".join(sorted(residual_hf.modeling_designs()))
            + ")"
        )
    run_tok = run_tokenizer(checkpoint, tokenizer)
    _require_transformers()
    progress(f"loading the weights of {checkpoint.path}")
    loaded = load_model(checkpoint, device="cpu", dtype=DTYPES[dtype] if dtype else None)
    state = hf_state_dict(loaded.model.state_dict(), model_config)
    config = hf_config(
        model_config,
        loaded.vocab_size,
        run_tok.eos_id,
        next(iter(state.values())).dtype,
        run_tok.bos_id,
    )

    with staged(out) as staging:
        progress(
            f"writing {sum(t.numel() for t in state.values()) / 1e6:.2f}M parameters to {staging}"
        )
        _write_weights(state, staging, max_shard_size)
        config.save_pretrained(staging)
        _generation_config(run_tok).save_pretrained(staging)
        _tokenizer(run_tok, model_config.seq_length).save_pretrained(staging)
        if not llama:
            (staging / f"{MODELING_NAME}.py").write_text(residual_hf.modeling_source())
    return Export(
        out,
        config.architectures[0],
        sorted(p.name for p in out.iterdir()),
        sum(t.numel() for t in state.values()),
    )


def _require_transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        raise UserInputError(
            "the Hugging Face export needs transformers: pip install 't2train[hf]'"
        )


# --- weights -------------------------------------------------------------------------------


def hf_state_dict(megatron: dict, model) -> dict[str, torch.Tensor]:
    """Megatron's TP = 1 state dict under the Hugging Face names, fused tensors split.

    ``model`` is the ``ModelConfig``. Megatron's fused QKV holds, per query group, the group's
    query heads, then its key head, then its value head; the gated MLP's fc1 holds [gate; up].
    A design's own parameters keep their names under ``model.``.
    """
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    head_dim = model.resolved_head_dim()
    state = {}
    for key, tensor in megatron.items():
        if key.endswith("_extra_state"):
            continue
        for name, value in _hf_tensors(key, tensor, heads, groups, head_dim).items():
            state[name] = value.detach().to("cpu").clone()  # no shared storage for safetensors
    return state


def _hf_tensors(key: str, tensor, heads: int, groups: int, head_dim: int) -> dict:
    if key == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": tensor}
    if key == "output_layer.weight":
        return {"lm_head.weight": tensor}
    if key == "decoder.final_layernorm.weight":
        return {"model.norm.weight": tensor}
    parts = key.split(".")
    if parts[:2] != ["decoder", "layers"]:
        if parts[0] != "decoder":
            raise ValueError(f"{key}: a model weight the exporter does not know")
        return {"model." + ".".join(parts[1:]): tensor}  # the stream's own parameters
    index, slot, rest = parts[2], parts[3], ".".join(parts[4:])
    prefix = f"model.layers.{index}.{_LAYER_SLOTS.get(slot, slot)}"
    if slot in _ATTENTION_SLOTS and rest in ("linear_qkv.weight", "linear_qkv.bias"):
        kind, width = rest.split(".")[1], tensor.shape[1:]  # a bias has no input width
        per_group = tensor.view(groups, heads // groups + 2, head_dim, *width)
        return {
            f"{prefix}.q_proj.{kind}": per_group[:, :-2].reshape(-1, *width),
            f"{prefix}.k_proj.{kind}": per_group[:, -2].reshape(-1, *width),
            f"{prefix}.v_proj.{kind}": per_group[:, -1].reshape(-1, *width),
        }
    if slot in _ATTENTION_SLOTS and rest == "linear_proj.weight":
        return {f"{prefix}.o_proj.weight": tensor}
    if slot in _ATTENTION_SLOTS and rest.split(".")[0] in _ATTENTION_NORMS:
        norm, kind = rest.split(".")
        return {f"{prefix}.{_ATTENTION_NORMS[norm]}.{kind}": tensor}
    if slot == "mlp" and rest == "linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return {f"{prefix}.gate_proj.weight": gate, f"{prefix}.up_proj.weight": up}
    if slot == "mlp" and rest == "linear_fc2.weight":
        return {f"{prefix}.down_proj.weight": tensor}
    return {f"{prefix}.{rest}": tensor}


def megatron_state_dict(hf: dict, model) -> dict[str, torch.Tensor]:
    """``hf_state_dict`` inverted for a Llama-family model (``standard``): Hugging Face names
    and split q/k/v (weights and, Qwen2's, biases) and gate/up tensors to Megatron's TP = 1
    state dict, Qwen3's q/k norms renamed. ``model`` is the ``ModelConfig``."""
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    head_dim = model.resolved_head_dim()
    megatron_slot = {hf_slot: slot for slot, hf_slot in _LAYER_SLOTS.items()}
    megatron_norm = {hf_norm: norm for norm, hf_norm in _ATTENTION_NORMS.items()}
    top = {
        "model.embed_tokens.weight": "embedding.word_embeddings.weight",
        "lm_head.weight": "output_layer.weight",
        "model.norm.weight": "decoder.final_layernorm.weight",
    }
    state: dict[str, torch.Tensor] = {}
    fused: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in hf.items():
        if name in top:
            state[top[name]] = tensor
            continue
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or parts[3] not in megatron_slot:
            raise ValueError(f"{name}: a weight a Llama does not have")
        prefix = f"decoder.layers.{parts[2]}.{megatron_slot[parts[3]]}"
        rest = ".".join(parts[4:])
        if rest in (
            "q_proj.weight",
            "k_proj.weight",
            "v_proj.weight",
            "gate_proj.weight",
            "up_proj.weight",
            "q_proj.bias",
            "k_proj.bias",
            "v_proj.bias",
        ):
            part, kind = rest.split("_")[0], rest.split(".")[1]
            fused.setdefault((prefix, kind), {})[part] = tensor
        elif rest in ("o_proj.weight", "down_proj.weight"):
            state[f"{prefix}.{'linear_proj' if rest[0] == 'o' else 'linear_fc2'}.weight"] = tensor
        elif rest in ("q_norm.weight", "k_norm.weight"):
            state[f"{prefix}.{megatron_norm[rest.split('.')[0]]}.weight"] = tensor
        else:
            state[f"{prefix}.{rest}"] = tensor
    for (prefix, kind), parts in fused.items():
        if prefix.endswith(".mlp"):
            state[f"{prefix}.linear_fc1.weight"] = torch.cat([parts["gate"], parts["up"]])
            continue
        width = parts["q"].shape[1:]  # a bias has no input width
        per_group = torch.cat(
            [
                parts["q"].view(groups, heads // groups, head_dim, *width),
                parts["k"].view(groups, 1, head_dim, *width),
                parts["v"].view(groups, 1, head_dim, *width),
            ],
            dim=1,
        )
        state[f"{prefix}.linear_qkv.{kind}"] = per_group.reshape(-1, *width)
    return state


def _write_weights(state: dict, folder: Path, max_shard_size: str | int) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file(
            {name: state[name] for name in names}, folder / filename, metadata={"format": "pt"}
        )
    if split.is_sharded:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": split.tensor_to_filename,
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# --- config, generation config, tokenizer ----------------------------------------------------


def hf_config(
    model, vocab_rows: int, eos_id: int, dtype: torch.dtype, bos_id: Optional[int] = None
):
    """The transformers config of a ``ModelConfig``: for a plain pre-norm Transformer, that
    of its family (``model.hf_architecture``: Llama, Mistral without a sliding window, Qwen2,
    Qwen3), else the modeling file's ``T2TrainConfig`` (with its ``auto_map``)."""
    shape = dict(
        vocab_size=vocab_rows,
        hidden_size=model.hidden_size,
        intermediate_size=model.resolved_ffn_hidden_size(),
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups or model.num_attention_heads,
        rms_norm_eps=model.norm_epsilon,
        rope_theta=float(model.rotary_base),
        max_position_embeddings=model.seq_length,
        head_dim=model.resolved_head_dim(),  # Qwen3's config has 128 unless told
        initializer_range=model.init_method_std,
        tie_word_embeddings=model.tie_embeddings,
        bos_token_id=eos_id if bos_id is None else bos_id,
        eos_token_id=eos_id,
        dtype=str(dtype).removeprefix("torch."),
    )
    if residual_hf.is_llama(model):
        return _family_config(model, shape)
    if model.qkv_bias or model.rope_scaling_factor:
        raise UserInputError(
            f"model.residual={model.residual!r} with model.qkv_bias or "
            "model.rope_scaling_factor: the modeling file implements neither "
            "(a plain pre-norm Transformer, without the mixer, exports as its "
            "Llama-family class)"
        )
    return residual_hf.modeling_module().T2TrainConfig(
        **shape,
        qk_norm=model.qk_norm,
        **residual_hf.config_fields(model),
        architectures=["T2TrainForCausalLM"],
        auto_map={
            "AutoConfig": f"{MODELING_NAME}.T2TrainConfig",
            "AutoModelForCausalLM": f"{MODELING_NAME}.T2TrainForCausalLM",
        },
    )


# The option of the standard design's attention that one family has and the others lack.
_FAMILY_ATTENTION = {
    "qkv_bias": ("Qwen2ForCausalLM", "q, k and v biases"),
    "qk_norm": ("Qwen3ForCausalLM", "q and k norms"),
}


def _family_config(model, shape: dict):
    """``LlamaConfig`` (Llama 3.1's RoPE scaling if set), ``MistralConfig``, ``Qwen2Config``
    or ``Qwen3Config``."""
    import transformers

    family = model.hf_architecture or "LlamaForCausalLM"
    for field, (owner, what) in _FAMILY_ATTENTION.items():
        if getattr(model, field) != (family == owner):
            raise UserInputError(
                f"model.{field}={getattr(model, field)} cannot be exported as {family} "
                f"({owner} has {what}, the other families none)"
            )
    if model.rope_scaling_factor and family != "LlamaForCausalLM":
        raise UserInputError(
            f"model.rope_scaling_factor={model.rope_scaling_factor} cannot be "
            f"exported as {family} (Llama 3.1's RoPE scaling is Llama's)"
        )
    families: dict[str, dict[str, object]] = {
        "LlamaForCausalLM": {"attention_bias": False, "mlp_bias": False},
        "MistralForCausalLM": {"sliding_window": None},
        "Qwen2ForCausalLM": {"use_sliding_window": False},
        "Qwen3ForCausalLM": {"use_sliding_window": False, "attention_bias": False},
    }
    extra = families[family]
    if model.rope_scaling_factor:
        extra["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": model.rope_scaling_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    config_class = getattr(transformers, family.replace("ForCausalLM", "Config"))
    return config_class(**shape, hidden_act="silu", architectures=[family], **extra)


def _generation_config(run_tok: RunTokenizer):
    from transformers import GenerationConfig

    bos = run_tok.eos_id if run_tok.bos_id is None else run_tok.bos_id
    return GenerationConfig(
        bos_token_id=bos, eos_token_id=run_tok.eos_id, pad_token_id=run_tok.eos_id
    )


def _tokenizer(run_tok: RunTokenizer, seq_length: int):
    from transformers import PreTrainedTokenizerFast

    bos = (
        run_tok.eos_token
        if run_tok.bos_id is None
        else run_tok.tokenizer.id_to_token(run_tok.bos_id)
    )
    return PreTrainedTokenizerFast(
        tokenizer_file=str(run_tok.path),
        eos_token=run_tok.eos_token,
        bos_token=bos,
        model_max_length=seq_length,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
