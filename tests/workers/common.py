"""Helpers shared by the torchrun workers (each worker is a script run on every rank)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def parse_args(extra=()) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    for name, kind in extra:
        parser.add_argument(name, type=kind)
    return parser.parse_args()


def write_result(out: Path, result: dict) -> None:
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))


def fixed_batch(vocab: int, batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(seq).expand(batch, seq)
