"""A whole model's state dict (its TP = PP = 1 names and shapes) split into the parts a rank
of any layout holds: the DeepSpeed engine's gathered shards (``deepspeed/export.py``), and a
weights file of ``t2train ckpt convert`` a fresh run starts from (``checkpoint.init_from``,
``read_file_weights``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.mlp import MLP

from t2train.checkpoint.errors import CheckpointError
from t2train.checkpoint.weights_file import read_weights_file
from t2train.config.schema import ModelConfig
from t2train.model.gpt import EMBEDDING_WEIGHT

OUTPUT_WEIGHT = "output_layer.weight"  # with tied embeddings, held only by a later stage
VOCAB_ROWS = {EMBEDDING_WEIGHT, OUTPUT_WEIGHT}  # padded per tensor-parallel size
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def parts_of(
    chunk, shards: list[dict], path: Path, split: tuple[int, int], what: str = "the weights"
) -> dict:
    """``chunk``'s state dict from consecutive tensor-parallel shards of a model written at
    PP = 1: its layers found by their number in the whole model, each tensor-parallel
    parameter joined across the shards and split in ``split`` = (parts, which) for this rank.
    ``what`` names the shards in an error."""
    tp_size, tp_rank = split
    gated = {
        f"{name}.linear_fc1.weight"
        for name, module in chunk.named_modules()
        if isinstance(module, MLP) and module.config.gated_linear_unit
    }
    parameters = dict(chunk.named_parameters())
    own_state = chunk.state_dict()
    state, missing = {}, []
    for name, own in own_state.items():
        if name.endswith("_extra_state"):
            state[name] = own  # the chunk's own: the shards hold no extra state
            continue
        source = chunk.whole_model_name(name)
        if source == OUTPUT_WEIGHT and source not in shards[0]:
            source = EMBEDDING_WEIGHT  # tied: a later stage's copy of the embedding
        if source not in shards[0]:
            missing.append(name)
            continue
        param = parameters.get(name)
        parts = [shard[source] for shard in shards]
        if param is None or not getattr(param, "tensor_model_parallel", False):
            state[name] = parts[0]
            continue
        dim, halves = param.partition_dim, 2 if name in gated else 1
        # The gated MLP's fc1 holds [gate; up] on each rank: each half is joined and split.
        pieces = [torch.cat(half, dim=dim) for half in zip(*(p.chunk(halves, dim) for p in parts))]
        if source in VOCAB_ROWS:
            pieces = [_rows(piece, own.shape[0] * tp_size) for piece in pieces]
        state[name] = torch.cat([piece.chunk(tp_size, dim)[tp_rank] for piece in pieces], dim)
    if missing:
        raise CheckpointError(
            f"{path}: {what} lack {missing[0]}"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}"
        )
    for name, own in own_state.items():
        if torch.is_tensor(own) and state[name].shape != own.shape:
            raise CheckpointError(
                f"{path}: {what} do not fit the recorded model "
                f"({name}: {tuple(state[name].shape)}, this rank holds {tuple(own.shape)})"
            )
    return state


def _rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocabulary padded to ``rows`` (another tensor-parallel size pads it to another
    multiple): the real rows kept, added padding rows zero, as dist-checkpointing loads an
    embedding of another padding."""
    if weight.shape[0] >= rows:
        return weight[:rows]
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def read_file_weights(file: Path, chunks: list, model: ModelConfig, vocab_size: int) -> list[dict]:
    """Collective: each bare chunk's weights at this rank's layout from the whole state dict
    in ``file``. One that does not fit the model (``vocab_size``: the run's, before padding)
    is refused on every rank alike, naming the first name or shape that differs and the
    config field that likely does."""
    state = read_weights_file(file)
    misfit = _misfit(
        {name: tuple(tensor.shape) for name, tensor in state.items()},
        _whole_shapes(chunks, model.tie_embeddings),
        model,
        vocab_size,
    )
    if misfit is not None:
        raise CheckpointError(f"{file}: does not fit this run's model: {misfit}")
    split = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank())
    return [parts_of(chunk, [state], file, split) for chunk in chunks]


def _whole_shapes(chunks: list, tied: bool) -> dict[str, tuple]:
    """Collective: every name and shape of the whole model at TP = PP = 1, from the chunks of
    all ranks (a pipeline stage holds only its layers)."""
    tp = ps.get_tensor_model_parallel_world_size()
    mine = {}
    for chunk in chunks:
        parameters = dict(chunk.named_parameters())
        for name, tensor in chunk.state_dict().items():
            if name.endswith("_extra_state"):
                continue
            shape = list(tensor.shape)
            param = parameters.get(name)
            if param is not None and getattr(param, "tensor_model_parallel", False):
                shape[param.partition_dim] *= tp
            mine[chunk.whole_model_name(name)] = tuple(shape)
    if tied:  # the last stage's copy of the embedding: no tensor of its own in the file
        mine.pop(OUTPUT_WEIGHT, None)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: shape for part in everyone for name, shape in part.items()}


def _misfit(
    theirs: dict[str, tuple], ours: dict[str, tuple], model: ModelConfig, vocab_size: int
) -> Optional[str]:
    """How the file's names and shapes (``theirs``) differ from the model's, first by layer
    count, then by name, then by shape; None when they fit."""
    layers = _layers(theirs), _layers(ours)
    if layers[0] != layers[1]:
        return (
            f"it holds {layers[0]} layers, this run's model {layers[1]}; model.num_layers "
            "likely differs"
        )
    for name in ours:
        if name not in theirs:
            return f"it lacks {name}; {_field_of_name(name)} likely differs"
    for name in theirs:
        if name not in ours:
            return (
                f"it holds {name}, which this run's model has not; "
                f"{_field_of_name(name)} likely differs"
            )
    for name, shape in ours.items():
        found = theirs[name]
        if name in VOCAB_ROWS and found[0] >= vocab_size:
            # more rows than tokens: padding (of another tensor-parallel size, perhaps), which
            # the split drops or extends with zeros
            found = (shape[0], *found[1:])
        if found != shape:
            return (
                f"{name} is {list(theirs[name])} there, {list(shape)} here; "
                f"{_field_of_shape(name, found, shape, model, vocab_size)} likely differs"
            )
    return None


def _layers(shapes: dict[str, tuple]) -> int:
    numbers = [int(found.group(1)) for name in shapes if (found := _LAYER.match(name))]
    return max(numbers, default=-1) + 1


def _field_of_name(name: str) -> str:
    """The config field a name present on one side only likely comes from."""
    if name == OUTPUT_WEIGHT:
        return "model.tie_embeddings"
    if name.endswith("linear_qkv.bias"):
        return "model.qkv_bias"
    if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return "model.qk_norm"
    return "model.residual (or its design's settings)"


def _field_of_shape(
    name: str, theirs: tuple, ours: tuple, model: ModelConfig, vocab_size: int
) -> str:
    """The config field that likely sets the dimension in which ``theirs`` and ``ours``
    differ."""
    if name in VOCAB_ROWS and theirs[0] < vocab_size:
        return f"model.vocab_size (this run's vocabulary has {vocab_size} tokens)"
    differ = [dim for dim, (a, b) in enumerate(zip(theirs, ours)) if a != b]
    if len(theirs) != len(ours) or not differ:
        return "model.residual (or its design's settings)"
    if ours[differ[0]] == model.hidden_size:
        return "model.hidden_size"
    if any(part in name for part in ("linear_qkv", "linear_proj", "q_layernorm", "k_layernorm")):
        return "model.num_attention_heads, model.num_query_groups or model.head_dim"
    if "linear_fc1" in name or "linear_fc2" in name:
        return "model.ffn_hidden_size"
    return "model.residual (or its design's settings)"
