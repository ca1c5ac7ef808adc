"""The wheel holds every module and data file of the source tree (a regular install trains)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Source folder -> its path inside the wheel (setup.py's SOURCE_ROOTS).
INSTALLED_AS = {
    "t2train": "t2train",
    "data": "t2train/data",
    "kernels": "t2train/kernels",
    "launch": "t2train/launch",
}


def _source_files() -> set[str]:
    files = set()
    for folder, installed in INSTALLED_AS.items():
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".yaml") and "__pycache__" not in path.parts:
                files.add(f"{installed}/{path.relative_to(REPO / folder).as_posix()}")
    return files


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_preset(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("t2train-*.whl")
    packed = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith((".py", ".yaml"))}
    expected = _source_files()
    assert len(expected) > 80 and "t2train/config/presets/tiny.yaml" in expected
    assert expected - packed == set(), "missing from the wheel"
    assert packed - expected == set(), "in the wheel but not in the source tree"
