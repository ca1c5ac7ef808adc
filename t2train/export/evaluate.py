"""``t2train eval CHECKPOINT --data DIR``: loss and perplexity over a prepared split.

Any dataset prepared with the run's tokenizer qualifies (the sha256 in its ``index.json``
must be the one the checkpoint records); every full sample of the split is read once, in
order, with the run's sequence length, and the mean is over all predicted tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from t2train.data.errors import DataError
from t2train.export.load import Checkpoint


@dataclass
class Evaluation:
    loss: float  # mean cross-entropy per token (nats)
    tokens: int  # tokens whose next token was predicted
    batches: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def check_same_tokenizer(checkpoint: Checkpoint, data: Path, run_hash: Optional[str]) -> dict:
    """The dataset's index; refused unless its tokenizer is the run's (both hashes named)."""
    from t2train.data.index import read_index

    index = read_index(data)
    theirs = index["tokenizer"]["sha256"]
    if run_hash is None:
        raise DataError(
            f"{checkpoint.path}: records no tokenizer hash and its dataset "
            f"{checkpoint.config.data.path!r} is not readable, so {data} cannot be "
            "checked against the run's tokenizer"
        )
    if theirs != run_hash:
        raise DataError(
            f"dataset {data}: prepared with tokenizer sha256 {theirs}, but the "
            f"checkpoint was trained with tokenizer sha256 {run_hash}; prepare it "
            "with the run's tokenizer (t2train data prepare --tokenizer)"
        )
    return index


@torch.no_grad()
def evaluate(
    model,
    data: Path,
    split: str,
    seq_length: int,
    batch_size: int,
    max_batches: Optional[int] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> Evaluation:
    """``progress(batches done)`` is called after each batch."""
    from t2train.data.loader import StreamingWorld, TokenBatches

    batches = TokenBatches(
        data,
        split,
        micro_batch_size=batch_size,
        seq_length=seq_length,
        world=StreamingWorld(0, 1, 0, 1),
        seed=0,
        shuffle=False,
        finite=True,
    )
    device = next(model.parameters()).device
    try:
        total, tokens, count = 0.0, 0, 0
        for batch in batches:
            ids, labels = batch["tokens"].to(device), batch["labels"].to(device)
            positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
            losses = model(ids, positions, None, labels=labels)
            total += float(losses.double().sum())
            tokens += labels.numel()
            count += 1
            if progress is not None:
                progress(count)
            if max_batches is not None and count >= max_batches:
                break
    finally:
        batches.close()
    if tokens == 0:
        raise DataError(f"{data}/{split}: no samples to evaluate")
    return Evaluation(total / tokens, tokens, count)
