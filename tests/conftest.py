"""Shared fixtures: isolated streaming state and a one-rank Megatron world for in-process tests."""

from __future__ import annotations

import gc
import os
import re
import tempfile
import time
from pathlib import Path

import pytest
import torch

pytest.register_assert_rewrite("suite_budget")
from suite_budget import load_record, longest_first  # noqa: E402 - after its rewrite is set up

# Without a GPU the Triton kernels (tests/kernels) run on Triton's CPU interpreter. Triton reads
# TRITON_INTERPRET when a @triton.jit function is defined, so it is set here, before any test
# module can import t2train.kernels: a helper defined without it cannot be called from a kernel
# defined with it. Elsewhere the kernels are only used on CUDA (T2_KERNELS=auto).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


# One intra-op thread per process, in the test workers and every process they start (the
# variable is inherited), as torchrun gives its workers: two workers and the ranks of the
# multi-process tests share two cores, and a second thread per process only spins against the
# others (the in-process files took 20-25% longer with it). A test that needs the variable
# unset (torchrun's banner) removes it from its child's environment.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


# The time budget: every run records each file's time; `make test` judges it (docs/testing.md).
pytest_plugins = ["suite_budget"]


def pytest_collection_modifyitems(config, items):
    """Skip the GPU tests without CUDA; run the files longest first (by the record of
    ``tests/durations.json``). ``make test`` hands whole files to its two workers
    (pytest-xdist, ``--dist loadfile --no-loadscope-reorder``) in this order, so the long
    files start first instead of ending the run alone; the order changes nothing else."""
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    root = config.rootpath
    files = list(dict.fromkeys(str(item.path.relative_to(root)) for item in items))
    rank = {name: position for position, name in enumerate(longest_first(files, load_record()))}
    items.sort(key=lambda item: rank[str(item.path.relative_to(root))])  # stable: files stay whole


@pytest.fixture(scope="session", autouse=True)
def isolated_streaming(tmp_path_factory):
    """Keep streaming's never-deleted filelocks out of /tmp, and its shared memory tidy.

    streaming puts ``<prefix>_*_filelock`` files in ``tempfile.gettempdir()`` (also in spawned
    children, hence TMPDIR) and segments in /dev/shm; segments that appeared during this session
    and that no live process uses are removed at the end (another session may be running).
    The processes are read before the files are listed, and a file changed since shortly
    before is left: the other test worker's trainers make segments meanwhile, with the names
    of segments listed here (a restarted trainer reuses its predecessor's prefix), and this
    cleaning once unlinked a resumed trainer's segments by name.
    """
    scratch = str(tmp_path_factory.mktemp("streaming-tmp"))
    before = set(os.listdir("/dev/shm"))
    saved_tempdir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = scratch
    yield
    tempfile.tempdir = saved_tempdir
    if saved_env is None:
        os.environ.pop("TMPDIR")
    else:
        os.environ["TMPDIR"] = saved_env
    gc.collect()
    from t2train.data.shm import SETTLING_S, changed_before

    settled = time.time() - SETTLING_S
    in_use = _shm_in_use()
    left = {
        name for name in set(os.listdir("/dev/shm")) - before if re.fullmatch(r"\d{6}_\w+", name)
    }
    for name in left - in_use:  # another session's live segments are not ours
        path = Path("/dev/shm", name)
        if changed_before(path, settled):
            path.unlink(missing_ok=True)


def _shm_in_use() -> set:
    """Names of /dev/shm segments some live process has open or mapped."""
    used = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            links = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
            maps = (proc / "maps").read_text().splitlines()
        except OSError:  # the process ended, or is not ours to read
            continue
        paths = links + [line.rsplit(" ", 1)[-1] for line in maps]
        used.update(path[len("/dev/shm/") :] for path in paths if path.startswith("/dev/shm/"))
    return used


@pytest.fixture(autouse=True)
def close_token_batches(monkeypatch):
    """Close every ``TokenBatches`` a test made, after it: tests drop them unclosed, and the
    suite's one process would keep each dataset's shared memory (a dozen or more file
    descriptors per dataset, until EMFILE; ``data/shm.py``)."""
    from t2train.data.loader import TokenBatches

    made = []
    init = TokenBatches.__init__

    def tracked(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(TokenBatches, "__init__", tracked)
    yield
    for batches in made:
        if hasattr(batches, "loader"):  # construction finished
            batches.close()


@pytest.fixture(scope="session")
def megatron_world():
    """torch.distributed (gloo, world 1) and Megatron's groups at TP = PP = 1."""
    from t2train.parallel.init import init_distributed, init_model_parallel, set_seed

    before = dict(os.environ)
    init_distributed()
    # init_distributed fills in RANK, MASTER_PORT, ...; trainers started by later tests must
    # not inherit them (they would bind this process's rendezvous port).
    os.environ.clear()
    os.environ.update(before)
    topology = init_model_parallel(1, 1, 1)
    set_seed(1234, topology)
    return topology


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory) -> Path:
    """Five plays as 64-token samples with a 1k BPE (seconds to prepare; cached corpus)."""
    from t2train.data.cli import default_cache_dir
    from t2train.data.corpora import fetch_corpus
    from t2train.data.errors import DataError
    from t2train.data.prepare import prepare_dataset

    try:
        files = fetch_corpus("shakespeare", default_cache_dir())
    except DataError as err:
        pytest.skip(f"Shakespeare corpus unavailable: {err}")
    plays = [
        str(f)
        for f in files
        if f.name.startswith(("hamlet", "macbeth", "othello", "lear", "tempest"))
    ]
    out = tmp_path_factory.mktemp("shakespeare") / "bpe1k-s64"
    prepare_dataset(plays, out, seq_length=64, vocab_size=1024, val_fraction=0.05)
    return out
