"""Whether a checkpoint can be trusted: checksums recorded at save and verified before a load,
the fallback to an older checkpoint when the newest is damaged, and the refusal to publish a
state that is not finite.

A shard truncated, or overwritten in place at its own size, may load without any error and
turn the parameters into NaN one update later. Every file of a checkpoint therefore gets an
xxh3_64 checksum (several GB/s on one core) and its size in ``CHECKSUMS`` when it is published;
the files are shared round robin over the ranks, so each reads back only its share of what was
just written (usually still in the page cache), and the same share is checked before a load.
Every checkpoint saved since records in its train state (which every load reads) that its
publication writes checksums (``recorded_checksums``): without the manifest it is damaged,
so losing the manifest cannot switch verification off. A checkpoint written before checksums
were recorded is loaded unverified (its shard sizes are still checked,
``compatibility.check_shard_files``).

Every function here is a collective when torch.distributed is initialized: all ranks get the
same answer, so none goes on alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import xxhash

from t2train.checkpoint.errors import CheckpointError, NonFiniteState
from t2train.checkpoint.paths import CHECKSUMS, LATEST, complete_steps, is_complete, step_dir_name
from t2train.checkpoint.train_state import read_train_state

ALGORITHM = "xxh3_64"
_CHUNK = 8 << 20


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _from_rank_zero(value):
    """Rank 0's ``value`` on every rank."""
    if _world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _merged(part: dict) -> dict:
    """Every rank's ``part``, merged, on every rank."""
    if _world()[1] == 1:
        return part
    parts: list = [None] * _world()[1]
    dist.all_gather_object(parts, part)
    return {key: value for each in parts for key, value in each.items()}


def _my_share(names: list[str]) -> list[str]:
    rank, world = _world()
    return names[rank::world]


def file_digest(path: Path) -> str:

    digest = xxhash.xxh3_64()
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def record_checksums(directory: Path) -> None:
    """Collective, once every rank's files are in ``directory``: rank 0 writes ``CHECKSUMS``
    with each file's size and checksum."""
    rank, _ = _world()
    names = _from_rank_zero(
        sorted(
            str(path.relative_to(directory))
            for path in directory.rglob("*")
            if path.is_file() and path.name != CHECKSUMS
        )
        if rank == 0
        else None
    )
    files = _merged(
        {
            name: {
                "bytes": (directory / name).stat().st_size,
                ALGORITHM: file_digest(directory / name),
            }
            for name in _my_share(names)
        }
    )
    if rank == 0:
        (directory / CHECKSUMS).write_text(
            json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, indent=1)
        )


def recorded_checksums() -> dict:
    """What an engine puts into a checkpoint's train state: that it is published with
    checksums (``publish_checkpoint`` writes them)."""
    return {"checksums": ALGORITHM}


def _missing_manifest(directory: Path) -> Optional[str]:
    """Why a checkpoint without ``CHECKSUMS`` is damaged, or None if it was saved before
    checksums were recorded."""
    try:
        algorithm = read_train_state(directory).get("checksums")
    except CheckpointError as err:
        return f"{directory / CHECKSUMS}: missing, and {err}"
    if algorithm is None:
        return None
    return (
        f"{directory / CHECKSUMS}: missing (the checkpoint was saved with {algorithm} "
        "checksums: the manifest was deleted or lost)"
    )


def _damage(directory: Path, name: str, recorded: dict) -> Optional[str]:
    path = directory / name
    if not path.is_file():
        return f"{path}: missing"
    size = path.stat().st_size
    if size != recorded["bytes"]:
        return (
            f"{path}: {size} bytes, {recorded['bytes']} when it was saved (truncated or replaced)"
        )
    if file_digest(path) != recorded[ALGORITHM]:
        return (
            f"{path}: content differs from the {ALGORITHM} checksum recorded when it was "
            f"saved (overwritten or corrupted in place)"
        )
    return None


def verify_checksums(directory: Path) -> Optional[str]:
    """Collective: what is damaged in checkpoint ``directory`` (the first file, by name), or
    None when every recorded file is intact or, saved before checksums, none were recorded."""
    rank, _ = _world()
    manifest = None
    if rank == 0:
        try:
            manifest = json.loads((directory / CHECKSUMS).read_text())
            manifest = {"files": dict(manifest["files"]), "algorithm": manifest["algorithm"]}
        except FileNotFoundError:
            manifest = _missing_manifest(directory)
        except (OSError, ValueError, KeyError, TypeError) as err:
            manifest = f"{directory / CHECKSUMS}: unreadable ({type(err).__name__}: {err})"
    manifest = _from_rank_zero(manifest)
    if manifest is None or isinstance(manifest, str):
        return manifest
    if manifest["algorithm"] != ALGORITHM:
        return f"{directory / CHECKSUMS}: unknown checksum algorithm {manifest['algorithm']!r}"
    files = manifest["files"]
    found = {
        name: why
        for name in _my_share(sorted(files))
        if (why := _damage(directory, name, files[name])) is not None
    }
    damaged = _merged(found)
    return damaged[min(damaged)] if damaged else None


def require_intact(directory: Path, setting: str = "") -> None:
    """Collective: raise ``CheckpointError`` naming the first damaged file of checkpoint
    ``directory`` (and the ``setting`` that named it, if any) unless its checksums verify."""
    damage = verify_checksums(directory)
    if damage is not None:
        raise CheckpointError(
            (f"{setting}: " if setting else "")
            + f"{directory} is damaged: {damage}; restore a copy, or use an "
            "earlier checkpoint of its run (`t2train ckpt verify` checks one)"
        )


def resume_candidates(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, the one ``latest`` names first, then newest first."""
    named = []
    try:
        marked = root / (root / LATEST).read_text().strip()
        if is_complete(marked):
            named = [marked]
    except (OSError, ValueError):
        pass
    return named + [
        root / step_dir_name(step)
        for step in reversed(complete_steps(root))
        if root / step_dir_name(step) not in named
    ]


def choose_verified(candidates: list[Path], fall_back: bool) -> tuple[Path, list[tuple[Path, str]]]:
    """Collective: the first of ``candidates`` whose checksums verify, and each one skipped
    before it with what is damaged. Without ``fall_back`` a damaged first candidate is refused,
    naming the checkpoint that would have been used."""
    skipped: list[tuple[Path, str]] = []
    for path in candidates:
        damage = verify_checksums(path)
        if damage is None:
            if skipped and not fall_back:
                raise CheckpointError(
                    f"{skipped[0][0]} is damaged: {skipped[0][1]}; refused "
                    f"(checkpoint.on_damaged=stop). The newest checkpoint that verifies is "
                    f"{path}: resume it with checkpoint.resume={path} or "
                    "checkpoint.on_damaged=fall_back"
                )
            return path, skipped
        skipped.append((path, damage))
    raise CheckpointError(
        f"no checkpoint under {candidates[0].parent} verifies: "
        + "; ".join(why for _, why in skipped)
        + "; restore a copy, or start "
        "again with checkpoint.resume=none checkpoint.overwrite=true"
    )


def say(message: str) -> None:
    """A warning on rank 0's stderr (before the run's monitor exists)."""
    if _world()[0] == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def optimizer_tensors(optimizer) -> list[tuple[str, torch.Tensor]]:
    """The tensors a torch optimizer updates and keeps: its (main) parameters and its state."""
    tensors = []
    for group_index, group in enumerate(optimizer.param_groups):
        for index, param in enumerate(group["params"]):
            where = f"optimizer group {group_index} parameter {index}"
            tensors.append((where, param))
            tensors += [
                (f"{where} {key}", value)
                for key, value in optimizer.state.get(param, {}).items()
                if torch.is_tensor(value)
            ]
    return tensors


def check_finite(named_tensors: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """Collective: raise ``NonFiniteState`` on every rank if any rank holds a NaN or inf in
    ``named_tensors`` (this rank's parameters and optimizer state), naming the first."""
    unique: dict = {}  # a tensor listed twice (model and optimizer) is checked once
    for name, tensor in named_tensors:
        unique.setdefault(id(tensor), (name, tensor))
    flags = [(name, torch.isfinite(tensor).all()) for name, tensor in unique.values()]
    bad = [name for name, finite in flags if not finite.item()]  # one wait on a GPU
    count, first = len(bad), (bad[0] if bad else None)
    _, world = _world()
    if world > 1:
        counts: list = [None] * world
        dist.all_gather_object(counts, (count, first))
        count = sum(c for c, _ in counts)
        first = next((name for _, name in counts if name), None)
    if count:
        raise NonFiniteState(
            f"{count} tensor(s) of the {what} hold NaN or inf (first: {first}); "
            "a checkpoint of it would poison every run resumed from it, so it "
            "is not published"
        )
