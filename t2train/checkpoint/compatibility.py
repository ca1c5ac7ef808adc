"""Refuse a checkpoint that cannot continue this run, naming what does not fit.

Checked before any tensor is read, so a wrong ``checkpoint.resume`` fails in seconds with
the field or file at fault, and nothing of the current run is touched.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

from t2train.checkpoint.errors import CheckpointError
from t2train.config.schema import ModelConfig
from t2train.residual import get_design, mixer, resolve_aliases

# Fields that fix the parameters' shapes or meaning; seq_length, attention backend,
# recompute and initialisation may change between runs. The residual design's section and the
# local mixer's are compared too, but for the fields their options declare
# ``not_architecture`` (initial values: a checkpoint written before such a field existed
# continues too).
_ARCHITECTURE = (
    "residual",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
    "tie_embeddings",
    "norm_epsilon",
    "rotary_base",
    "rope_scaling_factor",
    "qkv_bias",
    "qk_norm",
    "head_dim",
)


def _architecture(model: dict, with_design: bool) -> dict:
    # a field a checkpoint predates has its default (the model it wrote had no such option)
    fields = {name: model.get(name, getattr(ModelConfig, name, None)) for name in _ARCHITECTURE}
    shape = ModelConfig(
        hidden_size=model["hidden_size"],
        num_attention_heads=model["num_attention_heads"],
        ffn_hidden_size=model.get("ffn_hidden_size"),
        head_dim=model.get("head_dim"),
    )
    fields["ffn_hidden_size"] = shape.resolved_ffn_hidden_size()
    fields["head_dim"] = shape.resolved_head_dim()  # None and hidden/heads are one model
    parts = [mixer()] + ([get_design(model["residual"])] if with_design else [])
    for part in parts:
        if part.section is None:
            continue
        free = getattr(part.options, "not_architecture", ())
        fields.update(
            {
                f"{part.section}.{key}": value
                for key, value in (model.get(part.section) or {}).items()
                if key not in free
            }
        )
    return fields


def check_same_model(path: Path, train_state: dict, model: ModelConfig) -> None:
    """Raise CheckpointError naming each architecture field that differs from the run's."""
    saved = (train_state.get("config") or {}).get("model")
    if saved is None:  # written before checkpoints recorded their config
        return
    # A checkpoint of an older config format or spelling continues under the current one.
    saved = resolve_aliases(saved, train_state.get("config_format", 1))
    same_design = saved["residual"] == model.residual  # else its settings do not compare
    theirs = _architecture(saved, same_design)
    ours = _architecture(asdict(model), same_design)
    if saved.get("vocab_size") is None or model.vocab_size is None:  # taken from the data
        theirs.pop("vocab_size"), ours.pop("vocab_size")
    differ = [
        f"model.{name}: checkpoint {theirs.get(name)!r}, this run {ours.get(name)!r}"
        for name in sorted(theirs.keys() | ours.keys())
        if theirs.get(name) != ours.get(name)
    ]
    if differ:
        raise CheckpointError(f"{path}: written by a different model; " + "; ".join(differ))


def check_shard_files(path: Path) -> None:
    """Every shard file the checkpoint's index names exists and is long enough."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # missing or unreadable .metadata
        raise CheckpointError(f"{path}/.metadata: cannot read the shard index ({err})") from err
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"{shard}: shard file missing from the checkpoint")
        if shard.stat().st_size < size:
            raise CheckpointError(
                f"{shard}: shard file truncated ({shard.stat().st_size} bytes, "
                f"the index needs {size})"
            )
