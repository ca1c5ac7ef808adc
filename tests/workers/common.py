"""Helpers shared by the torchrun workers (each worker is a script run on every rank)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

import t2train  # noqa: F401 - first, as in a trainer: its import shims apply before megatron-core's


def parse_args(extra=()) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    for name, kind in extra:
        parser.add_argument(name, type=kind)
    return parser.parse_args()


def write_result(out: Path, result: dict) -> None:
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))


def finish() -> None:
    """Every rank done, then the process groups torn down before the interpreter exits: a
    rank leaving with gloo's threads alive once aborted at exit ("terminate called without
    an active exception") after its result was written."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def fixed_batch(vocab: int, batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(seq).expand(batch, seq)


_LAYOUTS: dict = {}  # (tp, pp, vpp) -> Megatron's parallel-state globals for that layout


def use_layout(tensor: int, pipeline: int, virtual: int):
    """Switch Megatron's process groups to a layout, creating each layout's groups once.

    ``destroy_model_parallel`` only forgets the groups and gloo keeps every group's polling
    threads alive, so re-creating groups for every run would pile up thousands of threads.
    Groups are kept per layout and Megatron's module globals swapped in and out instead.
    """
    from megatron.core import parallel_state

    from t2train.parallel.init import init_model_parallel

    def snapshot() -> dict:
        return {
            name: value
            for name, value in vars(parallel_state).items()
            if name.startswith("_") and name.isupper()
        }

    key = (tensor, pipeline, virtual)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if key in _LAYOUTS:
        for name, value in _LAYOUTS[key].items():
            setattr(parallel_state, name, value)
        return init_model_parallel(tensor, pipeline, virtual)
    topology = init_model_parallel(tensor, pipeline, virtual)
    _LAYOUTS[key] = snapshot()
    return topology
