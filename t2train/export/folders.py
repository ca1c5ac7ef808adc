"""The folder OUT a conversion writes (``export hf``, ``import hf``, ``ckpt convert``): a
non-empty one is refused without ``--overwrite``, and it is written whole or not at all.

Light (no torch): ``import hf`` checks OUT before it downloads anything.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from t2train.errors import UserInputError


def check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserInputError(f"output {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserInputError(
            f"output directory {out} is not empty; choose another one or pass "
            "--overwrite to replace it"
        )


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """The folder ``OUT.tmp`` to write OUT's files into: renamed to OUT when the block ends
    (an existing OUT is replaced only then), removed if it fails."""
    staging = out.with_name(out.name + ".tmp")
    if staging.exists():  # left by an interrupted export
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        yield staging
        _follow_umask(staging)
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _follow_umask(folder: Path) -> None:
    """Give every file the mode a plain ``open`` would: safetensors writes 0600."""
    umask = os.umask(0)
    os.umask(umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def _publish(staging: Path, out: Path) -> None:
    """Rename the finished folder to OUT (an existing OUT is replaced only now)."""
    replaced = out.with_name(out.name + ".replaced")
    if out.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(out, replaced)
    os.replace(staging, out)
    shutil.rmtree(replaced, ignore_errors=True)
