"""TokenBatches / reader_world: shapes, shifted labels, deterministic order, exact resume, and
data-parallel readers (with and without non-reading model-parallel peers) under gloo."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from datetime import timedelta
from itertools import islice
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from t2train.data.index import read_index
from t2train.data.loader import StreamingWorld, TokenBatches, reader_world
from t2train.data.prepare import DataError
from t2train.ports import free_port

ONE = StreamingWorld(0, 1, 0, 1)


def take(batches, n):
    return [b["tokens"].clone() for b in islice(batches, n)]


def take_ids(batches, n) -> list[int]:
    return [i for b in islice(batches, n) for i in b["sample_ids"].tolist()]


def test_shapes_and_labels_are_tokens_shifted_by_one(dataset):
    batches = TokenBatches(dataset, "train", 4, 32, ONE, seed=0)
    batch = next(batches)
    assert batch["tokens"].shape == batch["labels"].shape == (4, 32)
    assert batch["tokens"].dtype == batch["labels"].dtype == torch.int64
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])

    cropped = next(TokenBatches(dataset, "train", 4, 8, ONE, seed=0))
    assert cropped["tokens"].shape == (4, 8)
    assert torch.equal(cropped["tokens"], batch["tokens"][:, :8])
    assert torch.equal(cropped["labels"], batch["labels"][:, :8])
    assert "RANK" not in os.environ  # streaming's env is set only while it is called


def test_close_stops_workers_that_hold_the_stop_signals_blocked(dataset):
    """The trainer blocks its stop signals before DataLoader workers fork (t2train/signals.py),
    so the workers ignore the SIGTERM with which the interpreter's exit ends them and the exit
    waits forever; ``close`` shuts them down through torch's queues, also while an exception
    still holds the iterator."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    try:
        others = set(multiprocessing.active_children())
        batches = TokenBatches(dataset, "train", 4, 32, ONE, seed=0, num_workers=2)
        held = iter(batches.loader)  # what a traceback would keep alive
        next(held)
        workers = set(multiprocessing.active_children()) - others
        assert len(workers) == 2
        batches.close()
        assert not any(worker.is_alive() for worker in workers)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def test_order_is_deterministic_per_seed(dataset):
    first = take(TokenBatches(dataset, "train", 4, 32, ONE, seed=1), 5)
    again = take(TokenBatches(dataset, "train", 4, 32, ONE, seed=1), 5)
    other = take(TokenBatches(dataset, "train", 4, 32, ONE, seed=2), 5)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_state_dict_resumes_with_exactly_the_next_batches(dataset):
    per_epoch = read_index(dataset)["splits"]["train"]["samples"] // 8
    for consumed in (7, per_epoch + 3):  # mid-epoch, and into the second epoch
        batches = TokenBatches(dataset, "train", 8, 32, ONE, seed=5)
        seen = take_ids(batches, consumed)
        state = batches.state_dict()
        assert state["epoch"] == consumed // per_epoch
        assert state["sample_in_epoch"] == 8 * (consumed % per_epoch)
        following = take_ids(batches, per_epoch)  # crosses the next epoch boundary

        resumed = TokenBatches(dataset, "train", 8, 32, ONE, seed=5)
        resumed.load_state_dict(state)
        assert take_ids(resumed, per_epoch) == following
        this_epoch = (
            seen[8 * per_epoch * state["epoch"] :]
            + following[: 8 * (per_epoch - consumed % per_epoch)]
        )
        assert len(set(this_epoch)) == len(this_epoch)  # an epoch repeats no sample


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_position_survives_the_loss_of_streamings_shared_copy(dataset, workers):
    """mosaicml-streaming keeps a loaded position in a shared-memory segment named by the
    dataset's prefix (``<prefix>_resume``) and reads it back by name when a pass starts and at
    every ``state_dict``. A process that ended leaves its resource tracker to unlink, by
    name, the segments it created, also after a new dataset has taken the same prefix. Without
    the segment streaming starts the epoch at its first sample, silently, and records offset
    0 at the next save: a two-node restart trained its resumed steps on the epoch's first
    samples. Here the segment is unlinked as such a tracker would, right after the load and
    again after the pass began; with DataLoader workers too, which read it when they start."""
    batches = TokenBatches(dataset, "train", 8, 32, ONE, seed=5)
    take_ids(batches, 3)
    state = batches.state_dict()
    following = take_ids(batches, 4)

    resumed = TokenBatches(dataset, "train", 8, 32, ONE, seed=5, num_workers=workers)
    resumed.load_state_dict(state)
    segment = Path("/dev/shm") / f"{resumed.dataset._shm_prefix_int:06d}_resume"
    segment.unlink()
    assert take_ids(resumed, 2) == following[:16]
    segment.unlink(missing_ok=True)
    assert resumed.state_dict()["sample_in_epoch"] == state["sample_in_epoch"] + 16
    assert take_ids(resumed, 2) == following[16:]
    resumed.close()


def test_reading_the_position_opens_nothing_that_stays_open(dataset):
    """streaming's own ``state_dict`` attached to the resume segment at each call and kept
    the attachment until the process exits (an ``atexit`` cleanup): two descriptors per call,
    so a run that saves often enough ran out of them (EMFILE). A trainer reads the
    position at every save and at every pass's start."""
    batches = TokenBatches(dataset, "train", 8, 32, ONE, seed=5)
    take_ids(batches, 2)
    resumed = TokenBatches(dataset, "train", 8, 32, ONE, seed=5)
    resumed.load_state_dict(batches.state_dict())
    take_ids(resumed, 1)
    before = shared_memory_descriptors()
    for _ in range(50):
        resumed.state_dict()
    assert shared_memory_descriptors() == before


def shared_memory_descriptors() -> list[str]:
    """This process's open descriptors of /dev/shm files (streaming's reading threads open
    and close shard files meanwhile, so all descriptors together would not hold still)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("/dev/shm/"):
            found.append(target)
    return sorted(found)


def test_finite_mode_is_one_pass_per_loop(dataset):
    samples = read_index(dataset)["splits"]["val"]["samples"]
    val = TokenBatches(dataset, "val", 8, 32, ONE, seed=0, shuffle=False, finite=True)
    first = [b["tokens"] for b in val]
    second = [b["tokens"] for b in val]
    assert sum(len(b) for b in first) == samples  # the last batch may be short
    assert torch.equal(torch.cat(first), torch.cat(second))


def test_dataset_shorter_than_seq_length(dataset):
    with pytest.raises(
        DataError,
        match=r"seq_length=64: needs samples of 65 tokens, but the "
        r"samples of .* have 33 tokens",
    ):
        TokenBatches(dataset, "train", 4, 64, ONE, seed=0)


def test_split_smaller_than_a_micro_batch(dataset):
    samples = read_index(dataset)["splits"]["val"]["samples"]
    val = TokenBatches(dataset, "val", samples + 1, 32, ONE, seed=0)
    with pytest.raises(DataError, match=rf"val: {samples} samples give no full micro-batch"):
        next(val)


def _segments_open(prefix: str) -> list[str]:
    """This process's file descriptors on streaming's shared-memory segments of ``prefix``."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile (listdir's own descriptor)
            continue
    return [link for link in links if link.startswith(f"/dev/shm/{prefix}")]


@pytest.mark.parametrize("finished", [False, True], ids=["mid-pass", "after-pass"])
def test_close_releases_the_datasets_shared_memory(dataset, finished):
    """streaming keeps a dataset's segments open until the process exits (an atexit handler
    holds them); close() releases them, also while its reading threads are mid-pass."""
    batches = TokenBatches(dataset, "val", 4, 32, ONE, seed=0, finite=True)
    taken = list(batches) if finished else [next(batches)]
    assert taken
    prefix = f"{batches.dataset._shm_prefix_int:06d}_"
    assert len(_segments_open(prefix)) >= 6  # locals, barrier, epoch, cache, shard states...
    batches.close()
    assert _segments_open(prefix) == []
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


# Another job's live dataset (its own TMPDIR), then three datasets made and closed with this
# job's own lock directory (no earlier test's lock files that would skip the probes) and
# streaming's prefix search patched by t2train or not (argv[5]); prints this process's
# descriptors on the live one's segments before and after. In a child: probes left open stay
# until it exits (the test module is imported for its helpers).
PROBES = """
import contextlib, sys, tempfile
sys.path.insert(0, sys.argv[4])
from test_data_loader import ONE, _segments_open
from t2train.data import loader
from t2train.data.loader import TokenBatches
tempfile.tempdir = sys.argv[2]
live = TokenBatches(sys.argv[1], "val", 4, 32, ONE, seed=0)
next(live)
tempfile.tempdir = sys.argv[3]
if sys.argv[5] == "unpatched":
    loader.prefix_probes_closed_when_dropped = contextlib.nullcontext
prefix = f"{live.dataset._shm_prefix_int:06d}_"
held = len(_segments_open(prefix))
for _ in range(3):
    TokenBatches(sys.argv[1], "val", 4, 32, ONE, seed=0).close()
print(held, len(_segments_open(prefix)))
live.close()
"""


def _probe_descriptors(dataset, tmp_path, mode: str) -> tuple[int, int]:
    (tmp_path / "other").mkdir()
    (tmp_path / "this").mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            PROBES,
            str(dataset),
            str(tmp_path / "other"),
            str(tmp_path / "this"),
            str(Path(__file__).parent),
            mode,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    held, after = map(int, done.stdout.split())
    return held, after


def test_a_new_dataset_leaves_no_descriptor_on_another_jobs_segments(dataset, tmp_path):
    """streaming picks a new dataset's prefix by attaching to the segments of every prefix
    whose lock files it cannot see (another job's, with its own TMPDIR, as SLURM gives);
    those probes must not stay open (each would until the process exits)."""
    held, after = _probe_descriptors(dataset, tmp_path, "patched")
    assert after == held


def test_streaming_alone_still_leaves_the_probes_open(dataset, tmp_path):
    """What the test above guards against still happens without t2train's patch
    (``t2train/compat/streaming_prefix.py``): when streaming fixes it, the patch can go."""
    held, after = _probe_descriptors(dataset, tmp_path, "unpatched")
    assert after > held, "streaming now closes its prefix probes: drop the patch"


def test_reader_world_without_torch_distributed(monkeypatch):
    # An in-process test run earlier in this worker may have left a world of one initialized.
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert reader_world(True, 0, 1) == ONE
    assert reader_world(False, 0, 1) is None


def _rank_main(rank, world_size, readers, port, path, out_dir):
    """One process; the ranks in ``readers`` read (data-parallel rank = position), as tensor
    rank 0 of a replica does; the others idle, as its model-parallel peers do."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    reading = rank in readers
    world = reader_world(reading, readers.index(rank) if reading else 0, len(readers))
    result = {"world": None, "samples": []}
    if world is not None:
        result["world"] = [world.rank, world.world_size, world.local_rank, world.local_world_size]
        batches = TokenBatches(path, "train", 2, 32, world, seed=0, finite=True)
        result["samples"] = [row.tolist() for b in batches for row in b["tokens"]]
        result["state"] = batches.state_dict()
    # Without routing streaming's barriers to the readers' group, this barrier of the idle
    # rank would pair with a reader's barrier inside StreamingDataset() and break the run.
    dist.barrier()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size, readers", [(2, [0, 1]), (3, [0, 2])], ids=["dp2", "dp2-with-idle-peer"]
)
def test_data_parallel_readers_see_disjoint_halves(dataset, tmp_path, world_size, readers):
    mp.spawn(
        _rank_main,
        args=(world_size, readers, free_port("127.0.0.1"), str(dataset), str(tmp_path)),
        nprocs=world_size,
    )
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world_size)]
    assert all(results[r]["world"] is None for r in range(world_size) if r not in readers)
    first, second = (results[r] for r in readers)
    assert [first["world"], second["world"]] == [[0, 2, 0, 2], [1, 2, 1, 2]]
    assert first["state"] == second["state"]
    assert len(first["samples"]) == len(second["samples"])

    everything = {
        tuple(row.tolist())
        for b in TokenBatches(dataset, "train", 8, 32, ONE, seed=0, shuffle=False, finite=True)
        for row in b["tokens"]
    }
    seen = [{tuple(s) for s in r["samples"]} for r in (first, second)]
    assert seen[0] | seen[1] == everything
    # streaming pads an epoch to a multiple of the readers by repeating samples (here < 2)
    assert 0 <= 2 * len(first["samples"]) - len(everything) < 2
    assert len(seen[0] & seen[1]) < 2
