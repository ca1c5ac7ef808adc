"""The weights a fresh run starts from (``checkpoint.init_from``): a checkpoint of either
engine and of any layout, or a weights file of ``t2train ckpt convert`` (the whole model's
state dict), read into this rank's bare model chunks.

Each engine loads them before it wraps the chunks (Megatron's DDP and optimizer, or
``deepspeed.initialize``), so the optimizer's fp32 copies and ZeRO's partitions are made from
the loaded weights rather than patched afterwards. The engine that wrote a checkpoint reads
it: a Megatron engine checkpoint through dist-checkpointing, which reshards it for this rank;
a DeepSpeed one by gathering its ZeRO shards (``engine/deepspeed/export.py``). A weights file
is split for this rank once its names and shapes are found to be the model's
(``engine/split_weights.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from t2train.checkpoint.compatibility import check_same_model
from t2train.checkpoint.errors import CheckpointError
from t2train.checkpoint.inspect import resolve_checkpoint
from t2train.checkpoint.integrity import require_intact
from t2train.checkpoint.paths import checkpoint_engine
from t2train.checkpoint.train_state import read_train_state
from t2train.checkpoint.weights_file import SUFFIXES, is_verifiable, read_record, weights_file
from t2train.config.schema import Config
from t2train.engine import weights_reader


@dataclass(frozen=True)
class StartWeights:
    path: Path  # a complete checkpoint or a weights file, its checksums verified
    tokenizer_sha256: str  # of the tokenizer this run's data was prepared with
    vocab_size: int  # this run's, before padding: a weights file needs a row for each token

    @classmethod
    def named(cls, given: str, tokenizer_sha256: str, vocab_size: int) -> StartWeights:
        """Collective: the weights ``checkpoint.init_from=given`` names (a checkpoint, what
        leads to its newest one, or a weights file or its folder), once their checksums
        verify."""
        setting = f"checkpoint.init_from={given}"
        file = weights_file(Path(given))
        if file is not None:
            if is_verifiable(file):
                require_intact(file.parent, setting)
            return cls(file, tokenizer_sha256, vocab_size)
        try:
            path = resolve_checkpoint(Path(given))
        except CheckpointError as err:
            raise CheckpointError(
                f"{setting}: {err}, nor a weights file ({' or '.join(SUFFIXES)}, as `t2train "
                "ckpt convert` writes) or its folder"
            ) from None
        require_intact(path, setting)
        return cls(path, tokenizer_sha256, vocab_size)

    def check(self, config: Config) -> dict:
        """The checkpoint's train state (or what a weights file's folder records), once its
        model and tokenizer are found to be the run's (``train --dry-run`` checks this much;
        a weights file's tensors are checked when they are read)."""
        train_state = read_record(self.path) if self.path.is_file() else read_train_state(self.path)
        check_same_model(self.path, train_state, config.model)
        theirs = train_state.get("tokenizer_sha256")
        if theirs and theirs != self.tokenizer_sha256:
            raise CheckpointError(
                f"{self.path}: trained with tokenizer {theirs[:12]}, but data.path="
                f"{config.data.path} was prepared with {self.tokenizer_sha256[:12]}; "
                "prepare the data with that model's tokenizer (t2train data "
                "prepare --tokenizer)"
            )
        return train_state

    def load_into(self, chunks: list, config: Config) -> None:
        """Collective: every chunk of this rank gets the weights."""
        train_state = self.check(config)
        if self.path.is_file():
            from t2train.engine.split_weights import read_file_weights  # noqa: PLC0415 - megatron-core: loaded when weights are read

            weights = read_file_weights(self.path, chunks, config.model, self.vocab_size)
        else:
            read_weights = weights_reader(checkpoint_engine(self.path))
            weights = read_weights(self.path, train_state, chunks)
        for chunk, state in zip(chunks, weights):
            chunk.load_state_dict(state)
