"""The weights a fresh run starts from (``checkpoint.init_from``): a checkpoint of either
engine and of any layout, read into this rank's bare model chunks.

Each engine loads them before it wraps the chunks (Megatron's DDP and optimizer, or
``deepspeed.initialize``), so the optimizer's fp32 copies and ZeRO's partitions are made from
the loaded weights rather than patched afterwards. The engine that wrote the checkpoint reads
it: a Megatron engine checkpoint through dist-checkpointing, which reshards it for this rank;
a DeepSpeed one by gathering its ZeRO shards (``engine/deepspeed/export.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from t2train.checkpoint.compatibility import check_same_model
from t2train.checkpoint.errors import CheckpointError
from t2train.checkpoint.paths import checkpoint_engine
from t2train.checkpoint.train_state import read_train_state
from t2train.config.schema import Config


@dataclass(frozen=True)
class StartWeights:
    path: Path  # a complete checkpoint, its checksums verified
    tokenizer_sha256: str  # of the tokenizer this run's data was prepared with

    def check(self, config: Config) -> dict:
        """The checkpoint's train state, once its model and tokenizer are found to be the
        run's (``train --dry-run`` checks this much)."""
        train_state = read_train_state(self.path)
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
        """Collective: every chunk of this rank gets the checkpoint's weights."""
        train_state = self.check(config)
        if checkpoint_engine(self.path) == "deepspeed":
            from t2train.engine.deepspeed.export import read_weights  # noqa: PLC0415 - each engine's library loads when its checkpoint is read
        else:
            from t2train.engine.megatron.checkpoint import read_weights  # noqa: PLC0415 - each engine's library loads when its checkpoint is read
        for chunk, weights in zip(chunks, read_weights(self.path, train_state, chunks)):
            chunk.load_state_dict(weights)
