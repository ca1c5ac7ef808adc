"""Install ``.gpu-bundle/`` on the offline GPU machine without replacing anything there.

Each wheel is installed on its own with ``pip install --no-index --no-deps``, and only when
its distribution is missing, so the machine's torch, numpy, transformers, ... stay as they are.
Then t2train itself is installed in editable mode, its build backend (setuptools) taken from
the bundle. A wheel that fails to install is reported and skipped: the GPU check then says
which sections cannot run. Run from the repository root:

    python3 -m tools.gpu_check.install [--bundle .gpu-bundle]

(``python3 -m tools.gpu_check OUT_DIR`` runs it before the check.)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path


def distribution(wheel: Path) -> str:
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--disable-pip-version-check",
            *args,
        ],
        capture_output=True,
        text=True,
    )


def install_wheels(wheels: list[Path]) -> list[str]:
    lines = []
    for wheel in wheels:
        name = distribution(wheel)
        present = installed_version(name)
        if present:
            lines.append(f"kept     {name} {present} (already installed; bundle has {wheel.name})")
            continue
        result = pip(str(wheel))
        status = "installed" if result.returncode == 0 else "FAILED  "
        lines.append(
            f"{status} {wheel.name}"
            + ("" if result.returncode == 0 else f": {result.stderr.strip().splitlines()[-1:]}")
        )
    return lines


def install_project(bundle: Path) -> str:
    result = pip("--find-links", str(bundle / "build"), "--editable", ".")
    if result.returncode == 0:
        return f"installed t2train (editable) {installed_version('t2train')}"
    return f"FAILED   t2train (editable): {result.stderr.strip()[-400:]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=Path(".gpu-bundle"))
    args = parser.parse_args(argv)
    wheels = sorted((args.bundle / "wheels").glob("*.whl"))
    if not wheels:
        print(
            f"gpu_install: no wheels under {args.bundle}/wheels (run `make gpu-bundle` where "
            "there is network, and carry the folder)",
            file=sys.stderr,
        )
        return 1
    for line in install_wheels(wheels) + [install_project(args.bundle)]:
        print(f"gpu_install: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
