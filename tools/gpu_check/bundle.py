"""Build ``.gpu-bundle/``: what a bare, offline GPU machine needs for the GPU check.

The target machine (see docs/gpu/README.md) has CPython 3.12 on manylinux x86_64 with PyTorch,
Triton, NumPy, TensorBoard, transformers, tokenizers, psutil and PyYAML preinstalled, and no
network. This downloads, on a machine with network, the wheels it lacks, builds DeepSpeed's (a
source package on PyPI), a setuptools wheel as the offline build backend of ``pip install -e
.``, and two prepared datasets with their tokenizers (the check's, and the GPU comparison's
held-out split), then prints the bundle's size and fails above ``--max-mib`` (the bundle
travels with the checkout to the GPU node). ``tools/gpu_check/install.py`` installs it
there.

    python tools/gpu_check/bundle.py [--out .gpu-bundle] [--max-mib 48]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PYTHON_VERSION = "3.12"
GLIBC_MINOR = 39  # the machine's glibc is 2.39 (Ubuntu 24.04, Python 3.12.3): any older tag runs
# pip matches manylinux tags exactly, so every glibc the machine can run is listed.
PLATFORMS = tuple(f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC_MINOR, 4, -1)) + (
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)

# (pinned requirement, why it travels). Versions follow constraints/cpu.txt, the tested lock.
# tools/gpu_check/install.py installs a wheel only when its distribution is missing there, so the
# "fallback" ones (seen preinstalled on the machine) never replace the machine's own.
RUNTIME_WHEELS = (
    ("megatron-core==0.16.1", "not on the machine; the model, schedules, optimizer"),
    ("mosaicml-streaming==0.13.0", "not on the machine; the data loader"),
    ("torchao==0.18.0", "not on the machine; train.precision=fp8 (3.2 MiB)"),
    ("flash-attn-res==0.1.12", "the kernel benchmark's peer of Block AttnRes' kernels (18 KiB)"),
    ("catalogue==2.0.10", "imported by `import streaming` (registry)"),
    ("zstd==1.5.7.2", "imported by `import streaming` (compression)"),
    ("python-snappy==0.7.3", "imported by `import streaming` (compression)"),
    ("cramjam==2.14.0", "python-snappy's implementation"),
    ("brotli==1.2.1", "imported by `import streaming` (compression)"),
    ("xxhash==3.8.2", "fallback: preinstalled there; shard hashes"),
    ("psutil==7.2.2", "fallback: preinstalled there; megatron-core's checkpoint writer"),
    ("PyYAML==6.0.4", "fallback: preinstalled there; configs"),
    ("tokenizers==0.22.2", "fallback: preinstalled there (transformers needs it)"),
    # DeepSpeed's dependencies (the --stack check's ZeRO section, train.engine=deepspeed)
    ("pydantic==2.14.4", "DeepSpeed's config"),
    ("pydantic_core==2.50.5", "pydantic's compiled core"),
    ("annotated-types==0.8.0", "pydantic"),
    ("typing-inspection==0.4.5", "pydantic"),
    ("hjson==3.1.0", "DeepSpeed's config files"),
    ("ninja==1.13.2", "DeepSpeed's op builder (JIT)"),
    ("py-cpuinfo==9.0.0", "DeepSpeed's accelerator detection"),
    ("msgpack==1.2.4", "imported by `import deepspeed`"),
    ("einops==0.8.2", "imported by `import deepspeed`"),
    ("packaging==26.4", "fallback: DeepSpeed and megatron-core"),
    ("tqdm==4.70.1", "fallback: DeepSpeed"),
    ("typing_extensions==4.16.0", "fallback: pydantic"),
)
# Source packages on PyPI: built here into wheels (pure Python; no compiled ops, DeepSpeed
# JIT-builds the ones a run uses). They build against the torch installed here.
BUILT_WHEELS = (("deepspeed==0.19.8", "train.engine=deepspeed; DS_BUILD_OPS=0"),)
BUILD_WHEELS = (("setuptools==80.9.0", "build backend of `pip install -e .`, offline"),)
# The validation plays of `make heldout-data` (the CPU comparisons' split), both editions each.
HELDOUT_PLAYS = ("hamlet_*", "macbeth_*", "tempest_*")
# (name, seq_length, extra `t2train data prepare` arguments, what reads it)
DATASETS: tuple[tuple[str, int, list[str], str], ...] = (
    (
        "shakespeare-bpe4k-s4096",
        4096,
        [],
        "the check: samples of 4096 + 1 tokens, the 1b preset's length; shorter presets read a "
        "prefix",
    ),
    (
        "shakespeare-heldout-bpe4k-s1024",
        1024,
        [arg for plays in HELDOUT_PLAYS for arg in ("--val-files", plays)],
        "the GPU comparison (tools/gpu_check/compare.py, the 20m preset): whole plays held out",
    ),
)


def download(requirements: list[str], dest: Path) -> None:
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            PYTHON_VERSION,
            "--implementation",
            "cp",
            *platforms,
            "--dest",
            str(dest),
            *requirements,
        ],
        check=True,
    )


def build_wheels(requirements: list[str], dest: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(dest),
            *requirements,
        ],
        check=True,
        env=dict(os.environ, DS_BUILD_OPS="0"),
    )


def prepare_datasets(dest: Path) -> None:
    """Shakespeare with a 4k byte-level BPE, once per entry of ``DATASETS``."""
    for name, seq_length, extra, _ in DATASETS:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "t2train.cli",
                "data",
                "prepare",
                "--corpus",
                "shakespeare",
                "--out",
                str(dest / name),
                "--seq-length",
                str(seq_length),
                "--vocab-size",
                "4096",
                *extra,
            ],
            check=True,
        )


def size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def build(out: Path, max_mib: float) -> float:
    staging = out.with_name(out.name + ".incomplete")
    shutil.rmtree(staging, ignore_errors=True)
    download([req for req, _ in RUNTIME_WHEELS], staging / "wheels")
    build_wheels([req for req, _ in BUILT_WHEELS], staging / "wheels")
    download([req for req, _ in BUILD_WHEELS], staging / "build")
    prepare_datasets(staging / "data")
    manifest = {
        "python": PYTHON_VERSION,
        "platforms": PLATFORMS,
        "wheels": {req: why for req, why in RUNTIME_WHEELS + BUILT_WHEELS},
        "build": {req: why for req, why in BUILD_WHEELS},
        "datasets": {f"data/{name}": why for name, _, _, why in DATASETS},
        "files": sorted(str(f.relative_to(staging)) for f in staging.rglob("*") if f.is_file()),
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    mib = size_mib(staging)
    if mib > max_mib:
        raise SystemExit(
            f"error: {staging}: {mib:.1f} MiB, over the {max_mib:g} MiB limit "
            "(checkout + carried paths must stay under 64 MiB)"
        )
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return mib


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".gpu-bundle"))
    parser.add_argument("--max-mib", type=float, default=48.0)
    args = parser.parse_args(argv)
    mib = build(args.out, args.max_mib)
    print(f"{args.out}: {mib:.1f} MiB (limit {args.max_mib:g} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
