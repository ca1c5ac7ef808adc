"""``python3 -m tools.gpu_check OUT_DIR [--quick | --stack | --speed | --quality]``: the GPU
check on a fresh, offline machine (``--stack``: the rest of the stack, resume to export, a
command of its own; ``--speed`` and ``--quality``: the GPU window's two calls,
docs/gpu/README.md).

From the repository root: installs ``.gpu-bundle/`` without replacing anything installed,
then runs the check in a fresh interpreter (which sees what was installed), writing
``OUT_DIR/gpu-report.md``, ``gpu-report.json`` and ``gpu-check.log``, and prints the verdicts.
Only the standard library is imported before the install.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BUNDLE = ".gpu-bundle"
MODE_FLAGS = ("--quick", "--stack", "--speed", "--quality")  # check.py's modes


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    flags = [arg for arg in args if arg in MODE_FLAGS]
    args = [arg for arg in args if arg not in flags]
    if len(args) != 1 or len(flags) > 1:
        print(
            f"usage: python3 -m tools.gpu_check OUT_DIR [{' | '.join(MODE_FLAGS)}]",
            file=sys.stderr,
        )
        return 2
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.cwd() / ".cache" / "torch_extensions"))
    installed = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check.install", "--bundle", BUNDLE],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    (out / "gpu-check.log").write_text(installed.stdout)
    print(installed.stdout, end="", flush=True)
    status = subprocess.call(
        [
            sys.executable,
            "-m",
            "tools.gpu_check.check",
            "--out",
            str(out),
            "--data",
            f"{BUNDLE}/data/shakespeare-bpe4k-s4096",
            *flags,
        ],
        env=env,
    )
    report = out / "gpu-report.md"
    if report.is_file():  # the verdicts: the report's head, up to its environment section
        print(report.read_text().split("## Environment")[0], end="")
    return status


if __name__ == "__main__":
    sys.exit(main())
