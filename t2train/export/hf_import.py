"""``t2train import hf FOLDER OUT``: a Hugging Face Llama-family model as a t2train checkpoint.

FOLDER is a local model folder, or a Hugging Face Hub id (``org/name``) read through
huggingface_hub's cache (``HF_HOME``, ``HF_HUB_CACHE``): downloaded into it when the Hub is
reachable, taken from it alone under ``HF_HUB_OFFLINE=1`` or when the Hub cannot be reached.

Continued pretraining usually starts from someone's Llama. A Llama is the ``standard`` design
(pre-norm, RMSNorm, RoPE, SwiGLU, no biases), so its weights map onto Megatron's names exactly
(``hf.megatron_state_dict``, the export's mapping inverted). So do the families that differ
from it only where Megatron has the option: ``LlamaForCausalLM`` with Llama 3.1's RoPE scaling
(``model.rope_scaling_factor``), ``MistralForCausalLM`` without a sliding window,
``Qwen2ForCausalLM`` (biases on q, k and v: ``model.qkv_bias``) and ``Qwen3ForCausalLM``
(per-head RMSNorm on q and k: ``model.qk_norm``), each with its ``head_dim``
(``model.head_dim`` where it is not hidden_size / num_attention_heads). Anything else in a
config (another RoPE scaling, other biases, a sliding window, another activation) is refused
in one line naming the field; ``model.hf_architecture`` remembers the family, which the
export writes back. OUT becomes a run-like folder:

* ``checkpoints/step_00000000/``: the weights at TP = PP = 1 (torch_dist; they reshard into any
  layout), the model config and the tokenizer's hash, no optimizer state;
* ``tokenizer.json``: the folder's tokenizer as t2train saves it (its hash is the one recorded);
* ``t2train.yaml``: the ``model`` section and ``checkpoint.init_from``: OUT as an absolute path
  (the file works from any directory), for ``--config``.

``t2train export hf``, ``generate`` and ``eval`` read OUT like any checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import yaml

from t2train.errors import UserInputError
from t2train.export.folders import check_out
from t2train.residual import BASELINE

if TYPE_CHECKING:
    import torch

# The families that map onto the `standard` design, and the value each must have of the
# config fields the design does not implement otherwise (refused by name).
FAMILIES: dict[str, dict[str, object]] = {
    "LlamaForCausalLM": {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
    "MistralForCausalLM": {"sliding_window": None, "hidden_act": "silu"},
    "Qwen2ForCausalLM": {"use_sliding_window": False, "hidden_act": "silu"},
    # Qwen3's attention_bias puts a bias on o_proj too, which Megatron has only with the MLP's
    "Qwen3ForCausalLM": {
        "use_sliding_window": False,
        "hidden_act": "silu",
        "attention_bias": False,
    },
}
# Llama 3.1's RoPE scaling: the fields Megatron's implementation fixes, and their values.
LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


# A Hub id as huggingface_hub accepts one (org/name, each starting and ending with a letter,
# digit or _), and what an import reads of the repository: not its other formats (.bin,
# original/*.pth), which may be as large again.
HUB_ID = re.compile(r"\w(?:[\w.-]*\w)?/\w(?:[\w.-]*\w)?")
HUB_FILES = [
    "config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
]


@dataclass
class Imported:
    out: Path
    checkpoint: Path
    parameters: int
    config_file: Path


def hf_model_section(hf: dict, source: Path, seq_length: Optional[int]) -> dict:
    """The ``model`` config section of a Llama-family model's ``config.json``."""
    family = next((name for name in hf.get("architectures") or [] if name in FAMILIES), None)
    if family is None:
        raise UserInputError(
            f"{source}: architectures={hf.get('architectures')!r}; only "
            f"{', '.join(FAMILIES)} checkpoints can be imported"
        )
    for name, supported in FAMILIES[family].items():
        if hf.get(name, supported) != supported:
            raise UserInputError(
                f"{source}: {name}={hf[name]!r} is not supported (the "
                f"{BASELINE} design has {name}={supported!r})"
            )
    rope_scaling_factor = _rope_scaling_factor(hf.get("rope_scaling"), source)
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return {
        "residual": BASELINE,
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": None if kv_heads == heads else kv_heads,
        "head_dim": None if head_dim * heads == hf["hidden_size"] else head_dim,
        "ffn_hidden_size": hf["intermediate_size"],
        "seq_length": seq_length or hf["max_position_embeddings"],
        "vocab_size": hf["vocab_size"],
        "tie_embeddings": bool(hf.get("tie_word_embeddings")),
        "rotary_base": int(hf.get("rope_theta", 10000)),
        "rope_scaling_factor": rope_scaling_factor,
        "qkv_bias": family == "Qwen2ForCausalLM",
        "qk_norm": family == "Qwen3ForCausalLM",
        "hf_architecture": family,
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "init_method_std": float(hf.get("initializer_range", 0.02)),
    }


def _rope_scaling_factor(scaling: Optional[dict], source: Path) -> float:
    """``rope_scaling`` as Megatron's Llama 3.1 scaling factor (0.0 without scaling)."""
    if scaling is None:
        return 0.0
    kind = scaling.get("rope_type", scaling.get("type"))
    fixed = {name: float(scaling.get(name, -1)) for name in LLAMA3_ROPE}
    if kind != "llama3" or fixed != LLAMA3_ROPE or "factor" not in scaling:
        raise UserInputError(
            f"{source}: rope_scaling={scaling!r} is not supported (Llama 3.1's "
            f"rope_type 'llama3' with {LLAMA3_ROPE} and a factor is)"
        )
    return float(scaling["factor"])


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """``model.safetensors``, or the shards its ``model.safetensors.index.json`` names."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise UserInputError(
            f"{folder}: no model.safetensors (nor an index of shards); save "
            "the model with save_pretrained(..., safe_serialization=True)"
        )
    weights = {}
    for name in files:
        weights.update(load_file(str(folder / name)))
    return {
        name: tensor for name, tensor in weights.items() if not name.endswith("rotary_emb.inv_freq")
    }  # a buffer older exports kept


def model_folder(given: str | Path) -> tuple[Path, str]:
    """The local folder of ``given`` and where the checkpoint records it came from: a folder as
    it is; a Hub id not found as a folder through huggingface_hub's cache, downloaded into it
    when the Hub is reachable (a refusal names the id, the cache and why)."""
    path = Path(given)
    if path.exists() or not HUB_ID.fullmatch(str(given)):
        return path, str(path.resolve())
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    hub = f"{given}: no such folder; as a Hugging Face Hub id it"
    try:
        snapshot = Path(snapshot_download(str(given), allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise UserInputError(
            f"{hub} is not in the cache {constants.HF_HUB_CACHE} and {why}; download it "
            f"where the Hub is reachable (`hf download {given}`, the same HF_HOME) or give "
            "a local folder"
        ) from None
    except GatedRepoError:  # a RepositoryNotFoundError: first
        raise UserInputError(
            f"{hub} is gated: accept its license on the Hub, then log in (`hf auth login`, "
            "or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise UserInputError(
            f"{hub} is not on the Hub (or is private: log in with `hf auth login`, or HF_TOKEN)"
        ) from None
    except (HfHubHTTPError, HFValidationError, OSError) as err:
        lines = str(err).strip().splitlines()
        raise UserInputError(
            f"{hub} cannot be fetched ({type(err).__name__}: {lines[0] if lines else ''})"
        ) from None
    return snapshot, f"{constants.ENDPOINT}/{given}/tree/{snapshot.name}"


def import_hf(
    given: str | Path,
    out: str | Path,
    seq_length: Optional[int] = None,
    overwrite: bool = False,
    progress: Callable[[str], None] = lambda stage: None,
) -> Imported:
    from t2train.config.loader import config_from_dict

    out = Path(out)
    check_out(out, overwrite)  # before a download
    folder, source = model_folder(given)
    if not (folder / "config.json").is_file():
        raise UserInputError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    section = hf_model_section(
        json.loads((folder / "config.json").read_text()), folder / "config.json", seq_length
    )
    config = config_from_dict({"model": section})
    # torch, Megatron and transformers once the config maps: a refusal answers at once
    import torch
    from megatron.core import dist_checkpointing

    from t2train.checkpoint.integrity import recorded_checksums
    from t2train.checkpoint.paths import INCOMPLETE, step_dir_name
    from t2train.checkpoint.store import current_layout, publish_checkpoint
    from t2train.compat.megatron_writer import results_in_process
    from t2train.config.schema import CONFIG_FORMAT
    from t2train.data.tokenizer import default_bos_id, load_tokenizer, save_tokenizer
    from t2train.export.hf import megatron_state_dict
    from t2train.export.load import build_model, single_process_world
    from t2train.version import code_version

    tokenizer = load_tokenizer(folder)
    progress(f"reading the weights of {folder}")
    hf_weights = read_safetensors(folder)
    if config.model.tie_embeddings:  # Megatron's output layer reads the embedding itself
        hf_weights.pop("lm_head.weight", None)
    dtype = next(iter(hf_weights.values())).dtype
    state = megatron_state_dict(hf_weights, config.model)

    single_process_world()
    vocab = config.model.vocab_size or 0  # the imported config always gives it
    model = build_model(config, config.padded_vocab_size(vocab), dtype)
    own = model.state_dict()
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in state:  # Megatron pads the vocabulary: the extra rows stay zero
            padded = torch.zeros_like(own[name])
            padded[: state[name].shape[0]] = state[name]
            state[name] = padded
    missing = sorted(set(own) - set(state) - {k for k in own if k.endswith("_extra_state")})
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise UserInputError(
            f"{folder}: the weights do not fit a {section['hf_architecture']} "
            f"of its config.json (missing {missing[:3]}, unexpected "
            f"{extra[:3]})"
        )
    model.load_state_dict(state, strict=False)

    if out.exists():  # empty, or --overwrite: replaced
        shutil.rmtree(out)
    out.mkdir(parents=True)
    root = out / "checkpoints"
    final = root / step_dir_name(0)
    staging = root / (final.name + INCOMPLETE)
    staging.mkdir(parents=True, exist_ok=True)
    sha = save_tokenizer(tokenizer, out)
    progress(f"saving them as the checkpoint {final}")
    train_state = {
        "step": 0,
        "layout": current_layout(),
        "has_optimizer": False,
        "config": asdict(config),
        "config_format": CONFIG_FORMAT,
        "code_version": code_version(),
        "tokenizer_sha256": sha,
        "bos_id": default_bos_id(tokenizer),
        "imported_from": source,
        **recorded_checksums(),
    }
    with results_in_process():
        dist_checkpointing.save(
            {"model": model.sharded_state_dict(), "train_state": train_state}, str(staging)
        )
    publish_checkpoint(root, staging, final, None)
    config_file = out / "t2train.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {"model": section, "checkpoint": {"init_from": str(out.resolve())}}, sort_keys=False
        )
    )
    return Imported(out, final, sum(t.numel() for t in hf_weights.values()), config_file)
