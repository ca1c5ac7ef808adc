"""What a run reads before it writes anything: the dataset's facts and the checkpoint to
resume. Checked first, so a bad input never creates or alters a run directory (also by
``t2train config``, which checks the dataset alone)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from t2train.checkpoint.paths import is_complete
from t2train.config.schema import Config, ConfigError
from t2train.data.index import read_index


def dataset_facts(config: Config) -> dict:
    """The vocabulary the model is built for, the tokenizer's hash and the token that starts
    each document (None: none), from ``data.path``."""
    if not config.data.path:
        raise ConfigError(
            "data.path='': must name a prepared dataset directory (see `t2train data prepare`)"
        )
    index = read_index(config.data.path)
    if config.model.seq_length > index["seq_length"]:
        raise ConfigError(
            f"model.seq_length={config.model.seq_length}: longer than the "
            f"dataset's samples ({index['seq_length']} tokens) in {config.data.path}"
        )
    vocab = config.model.vocab_size or index["vocab_size"]
    if vocab < index["vocab_size"]:
        raise ConfigError(
            f"model.vocab_size={vocab}: smaller than the tokenizer's vocabulary "
            f"({index['vocab_size']}) of {config.data.path}"
        )
    for label, path in config.data.labelled_eval_sets():
        other = read_index(path)["tokenizer"]["sha256"]
        if other != index["tokenizer"]["sha256"]:
            raise ConfigError(
                f"data.eval_sets: {label}={path} was prepared with another "
                f"tokenizer (sha256 {other[:12]}) than data.path "
                f"({index['tokenizer']['sha256'][:12]}); prepare it with "
                f"--tokenizer {config.data.path}/tokenizer.json"
            )
    return {
        "vocab_size": vocab,
        "tokenizer_sha256": index["tokenizer"]["sha256"],
        "bos_id": index.get("bos_id"),
    }


def resume_target(config: Config, run_dir: Path) -> Optional[Path]:
    """Which checkpoint to start from, decided before anything is written."""
    from t2train.checkpoint.store import find_latest  # noqa: PLC0415 - megatron-core: not for `t2train config`

    resume = config.checkpoint.resume
    if resume == "auto":
        # unfinished saves are removed once the run holds its directory's lock (trainer.py)
        return find_latest(run_dir / "checkpoints", warn_incomplete=False)
    if resume == "none":
        if run_dir.exists() and any(run_dir.iterdir()) and not config.checkpoint.overwrite:
            raise ConfigError(
                f"checkpoint.resume=none: run directory {run_dir} is not empty; "
                "resume it (checkpoint.resume=auto), choose another name, or set "
                "checkpoint.overwrite=true"
            )
        return None
    path = Path(resume)
    if not is_complete(path):
        raise ConfigError(f"checkpoint.resume={resume!r}: not a checkpoint directory")
    return path
