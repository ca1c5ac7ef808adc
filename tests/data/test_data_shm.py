"""Shared memory and lock files of a killed (SIGKILL) reader are removed at start; those of a
live dataset are kept and it reads on."""

from __future__ import annotations

import mmap
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from t2train.data import loader
from t2train.data.loader import StreamingWorld, TokenBatches
from t2train.data.shm import SHM_DIR, clean_stale_streaming_files

from suite_budget import patient

ONE = StreamingWorld(0, 1, 0, 1)
READER = """
import sys, time
from t2train.data import loader
from t2train.data.loader import StreamingWorld, TokenBatches
batches = TokenBatches(sys.argv[1], "train", 4, 32, StreamingWorld(0, 1, 0, 1), seed=0)
next(batches)
print("reading", flush=True)
time.sleep(600)
"""


def mapped_segments(pid: int) -> set[Path]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {Path(p) for p in re.findall(rf"({SHM_DIR}/\d{{6}}_\w+)", maps)}


def prefix(path: Path) -> int:
    return int(path.name[:6])


@pytest.mark.slow
@pytest.mark.own_dev_shm
def test_files_of_a_killed_run_are_removed_and_live_ones_kept(dataset, tmp_path, monkeypatch):
    locks = tmp_path / "locks"
    locks.mkdir()
    # Its own session, killed as a whole as a scheduler kills a job: else Python's resource
    # tracker of the reader outlives it and unlinks some segments by itself.
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(dataset)],
        text=True,
        stdout=subprocess.PIPE,
        env=dict(os.environ, TMPDIR=str(locks)),
        start_new_session=True,
    )
    try:
        assert reader.stdout.readline() == "reading\n"
        # streaming's prepare thread makes the cache lock file at its first sample, which may
        # come after the first batch was read: wait for it (the test failed once without)
        deadline = time.monotonic() + patient(60)
        while len(list(locks.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        # Its lock files name its prefix; it also maps segments of the live datasets of
        # earlier tests in this process (streaming attaches them while choosing a prefix).
        (dead_prefix,) = {prefix(p) for p in locks.iterdir()}
        dead_segments = {p for p in mapped_segments(reader.pid) if prefix(p) == dead_prefix}
    finally:
        os.killpg(reader.pid, signal.SIGKILL)
        reader.wait()
    dead = dead_segments | set(locks.iterdir())
    assert dead_segments and all(p.exists() for p in dead_segments)  # left behind
    aged(dead)  # the next job starts seconds after the kill, not within the settling time
    assert {p.name[7:] for p in locks.iterdir()} == {"barrier_filelock", "cache_filelock"}

    # A new reader process cleans at start (lock files go to tempfile.gettempdir()), so the
    # dead run's prefix is free again (streaming skips a prefix that has lock files).
    monkeypatch.setattr(tempfile, "tempdir", str(locks))
    monkeypatch.setattr(loader, "_host_cleaned", False)
    live = TokenBatches(dataset, "val", 4, 32, ONE, seed=0)
    next(live)
    live_prefix = live.dataset._shm_prefix_int
    assert live_prefix <= dead_prefix
    assert all(not p.exists() or prefix(p) == live_prefix for p in dead)
    kept = {
        p for p in mapped_segments(os.getpid()) | set(locks.iterdir()) if prefix(p) == live_prefix
    }
    assert len({p.parent for p in kept}) == 2  # live segments and live lock files

    # Cleaning again (another job starting on this host) leaves the live dataset alone.
    assert not set(clean_stale_streaming_files(locks)) & kept
    assert all(p.exists() for p in kept)
    assert next(live)["tokens"].shape == (4, 32)


# Picks its streaming prefix as soon as the other racer has imported too (both touch a file
# in the directory argv[2], then wait for two), and waits 2 s between finding a free prefix and
# registering it (a slow host), with or without t2train's lock (argv[3]); stays alive 3 s more
# so that its segments outlive the other's registration.
RACER = """
import contextlib, os, pathlib, sys, time
from streaming.base.shared import prefix
from t2train.data import loader
from t2train.data.loader import StreamingWorld, TokenBatches
pack = prefix._pack_locals  # the leader packs its locals between finding and registering
def slow_pack(*args):
    time.sleep(2)
    return pack(*args)
prefix._pack_locals = slow_pack
if sys.argv[3] == "unlocked":
    loader.prefix_chosen_by_the_leader = lambda group: contextlib.nullcontext()
ready = pathlib.Path(sys.argv[2])
(ready / str(os.getpid())).touch()
deadline = time.time() + 60  # imports take seconds on a loaded machine
while len(list(ready.iterdir())) < 2 and time.time() < deadline:
    time.sleep(0.01)
try:
    batches = TokenBatches(sys.argv[1], "train", 4, 32, StreamingWorld(0, 1, 0, 1), seed=0)
    print("prefix", batches.dataset._shm_prefix_int, flush=True)
except FileExistsError as error:
    print("FileExistsError", error, flush=True)
time.sleep(3)
"""


def _race(dataset, mode: str, ready: Path) -> list[str]:
    """Two jobs' readers start together on this host; what each printed."""
    ready.mkdir()
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(dataset), str(ready), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [racer.communicate(timeout=120) for racer in racers]
    assert all(racer.returncode == 0 for racer in racers), [err[-2000:] for _, err in outputs]
    return sorted(out.strip() for out, _ in outputs)


@pytest.mark.slow
def test_two_jobs_starting_together_get_their_own_prefixes(dataset, tmp_path):
    """Without the lock both find the same free prefix and the second to register it fails
    (streaming's race, reproduced); with it the second looks after the first registered."""
    unlocked = _race(dataset, "unlocked", tmp_path / "unlocked")
    assert unlocked[0].startswith("FileExistsError") and "_locals" in unlocked[0], unlocked
    locked = _race(dataset, "locked", tmp_path / "locked")
    assert all(line.startswith("prefix ") for line in locked), locked
    assert len(set(locked)) == 2, locked


def aged(paths, seconds: float = 10.0) -> None:
    """Files as a run killed ``seconds`` ago left them."""
    then = time.time() - seconds
    for path in paths:
        os.utime(path, (then, then))


def test_a_file_made_while_the_scan_runs_is_left_to_its_dataset(tmp_path, monkeypatch):
    """A dataset of another process registers its prefix while a clean scans the processes'
    maps, after the scan read that process's: its new segment is mapped by nobody the scan
    saw. It is left (it was unlinked, which freed the live dataset's prefix for the next);
    once old and still unmapped, a later clean removes it."""
    from t2train.data import shm

    path = SHM_DIR / "999997_locals"
    scan = shm._mapped_prefixes

    def scan_while_a_dataset_registers() -> set[str]:
        live = scan()
        path.write_bytes(b"\0" * 4096)
        return live

    monkeypatch.setattr(shm, "_mapped_prefixes", scan_while_a_dataset_registers)
    try:
        assert path not in clean_stale_streaming_files(tmp_path) and path.exists()
        monkeypatch.setattr(shm, "_mapped_prefixes", scan)
        aged([path])
        assert path in clean_stale_streaming_files(tmp_path) and not path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_a_mapping_of_an_unlinked_segment_protects_no_later_file(tmp_path):
    """A process still maps a prefix's segment that was unlinked since; files of that prefix
    left later by a killed run are stale all the same, and a live mapping keeps them."""
    path = SHM_DIR / "999998_locals"
    with path.open("w+b") as old:
        old.write(b"\0" * 4096)
        old.flush()
        unlinked = mmap.mmap(old.fileno(), 4096)
    path.unlink()
    try:
        path.write_bytes(b"\0" * 4096)  # a killed run's leftover of the same name
        aged([path])
        assert path in clean_stale_streaming_files(tmp_path) and not path.exists()
        path.write_bytes(b"\0" * 4096)
        with path.open("r+b") as live_file, mmap.mmap(live_file.fileno(), 4096):
            assert path not in clean_stale_streaming_files(tmp_path) and path.exists()
    finally:
        unlinked.close()
        path.unlink(missing_ok=True)


def test_only_mappings_of_this_dev_shm_keep_a_prefix_alive():
    """A process in another mount namespace (a container, a job with a private /dev/shm)
    maps its own /dev/shm/000000_...: the same path, another device, and it protects nothing
    here (the other test worker's live dataset once kept a killed run's prefix here)."""
    from t2train.data.shm import prefixes_mapped

    maps = (
        "7f0000000000-7f0000001000 rw-s 00000000 00:1a 4242 /dev/shm/000000_locals\n"
        "7f0000001000-7f0000002000 rw-s 00000000 00:2b 4243 /dev/shm/000001_barrier\n"
        "7f0000002000-7f0000003000 rw-s 00000000 00:1a 4244 /dev/shm/000002_epoch_data (deleted)\n"
        "7f0000003000-7f0000004000 r-xp 00000000 08:01 77 /usr/lib/libc.so.6\n"
    )
    assert prefixes_mapped(maps, (0, 0x1A)) == {"000000"}
    assert prefixes_mapped(maps, (0, 0x2B)) == {"000001"}
    with open(SHM_DIR / "999998_locals", "wb") as segment:  # mapped here: alive
        segment.write(b"\0" * mmap.PAGESIZE)
    try:
        with open(SHM_DIR / "999998_locals", "r+b") as segment, mmap.mmap(segment.fileno(), 0):
            from t2train.data.shm import _mapped_prefixes

            assert "999998" in _mapped_prefixes()
    finally:
        (SHM_DIR / "999998_locals").unlink()


# One of two readers of one job on this host (torch.distributed rank $RANK of 2): opens the
# dataset argv[1] with t2train's prefix choice, or streaming's own (argv[3] == "streaming").
# The leader says when it has searched for a free prefix (touches argv[2]/searched); the
# other reader, when it searches, waits first for argv[2]/changed: the host's segments
# changed between the two searches, as they do in a restart or on a busy host.
READER_OF_TWO = """
import contextlib, os, pathlib, sys, time
from datetime import timedelta
import torch.distributed as dist
from streaming.base.constant import SHM_TO_CLEAN
from streaming.base.shared import prefix
from t2train.data import loader
from t2train.data.loader import TokenBatches, reader_world
rank, flags = int(os.environ["RANK"]), pathlib.Path(sys.argv[2])
if sys.argv[3] == "streaming":
    loader.prefix_chosen_by_the_leader = lambda group: contextlib.nullcontext()
search, searched = prefix._check_and_find_retrying, []
def observed(*args, **kwargs):
    deadline = time.time() + 120
    while rank and not (flags / "changed").exists() and time.time() < deadline:
        time.sleep(0.01)
    searched.append(search(*args, **kwargs))
    if rank == 0 and len(searched) == len(SHM_TO_CLEAN):
        (flags / "searched").touch()
    return searched[-1]
prefix._check_and_find_retrying = observed
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
try:
    batches = TokenBatches(sys.argv[1], "train", 4, 32, reader_world(True, rank, 2), seed=0)
    print("prefix", batches.dataset._shm_prefix_int, flush=True)
except RuntimeError as error:
    print("RuntimeError:", error, flush=True)
    os._exit(1)
dist.barrier()
dist.destroy_process_group()
"""


def _two_readers(dataset, mode: str, flags: Path) -> list[str]:
    """Two readers of one job start while another job's dataset holds prefix 0; once the
    leader has searched, that dataset ends (its segments go). What each reader printed."""
    from streaming.base.shared.prefix import _pack_locals

    from t2train.ports import free_port

    flags.mkdir()
    other = SHM_DIR / "000000_locals"  # another job's, on a host of its own (own_dev_shm)
    data = _pack_locals([str(flags / "another-job")], 0)
    other.write_bytes(data)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    with other.open("r+b") as segment, mmap.mmap(segment.fileno(), 0) as mapped:
        readers = [
            subprocess.Popen(
                [sys.executable, "-c", READER_OF_TWO, str(dataset), str(flags), mode],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(env, RANK=str(rank)),
            )
            for rank in range(2)
        ]
        try:
            deadline = time.monotonic() + patient(120)
            while not (flags / "searched").exists():
                assert time.monotonic() < deadline and all(r.poll() is None for r in readers), [
                    r.communicate()[1][-2000:] for r in readers if r.poll() is not None
                ]
                time.sleep(0.05)
            mapped.close()
            other.unlink()
            (flags / "changed").touch()
            outputs = [readers[1].communicate(timeout=120)]
            outputs.insert(0, readers[0].communicate(timeout=10 if mode == "streaming" else 120))
        except subprocess.TimeoutExpired:  # the leader, waiting for the failed reader
            outputs.insert(0, ("", ""))
        finally:
            for reader in readers:
                reader.kill()
                reader.wait()
    return [out.strip() or err.strip()[-2000:] for out, err in outputs]


@pytest.mark.slow
@pytest.mark.own_dev_shm
def test_the_readers_of_a_host_take_the_prefix_their_leader_registered(dataset, tmp_path):
    """Every reader of a host took a prefix of its own search, the leader registering its
    own: when another job's dataset ended between the two searches (or a killed attempt's
    segments were being removed), the other reader found the freed prefix, which its leader
    never registered, and failed opening its data ("was not registered by local leader", or
    "does not match local leader": reproduced with streaming's own choice). With t2train's,
    the leader searches alone and its readers take the prefix it registered."""
    streaming = _two_readers(dataset, "streaming", tmp_path / "streaming")
    assert "was not registered by local leader" in streaming[1], streaming
    chosen = _two_readers(dataset, "chosen", tmp_path / "chosen")
    assert chosen == ["prefix 1", "prefix 1"], chosen
