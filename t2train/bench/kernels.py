"""``t2train bench kernels`` (or ``python -m t2train.bench.kernels``): the fused Triton kernels
against their peers at preset shapes.

The GPU check's kernel section (``tools/gpu_check/kernels.py``) runs the same cases.
Shapes: one micro-batch of the preset (sequence, width, heads, query groups) with its design
options (each design's defaults unless the preset or the overrides set them; each design
folder's ``benchmarks.py`` says which it reads). On the GPU in bf16 against eager,
``torch.compile`` and the peers a case adds; in the check's dry run in fp32 on the CPU with
the Triton interpreter (its bf16 ``tl.dot`` is wrong) and dynamo's eager backend, which only
proves the harness runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

# --dry-run's shape: the tiny preset cut to two narrow layers and 8 tokens (the interpreter
# takes seconds per call).
DRY_RUN_SHAPE = (
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.num_query_groups=1",
    "model.seq_length=8",
    "train.micro_batch_size=1",
    "train.global_batch_size=1",
)


def preset_shapes(label: str, preset: str, overrides):
    """The ``KernelShapes`` of one micro-batch of ``preset`` with ``overrides``."""
    from t2train.config.loader import load_config
    from t2train.kernels.benchmark import KernelShapes

    config = load_config(preset, None, ["data.path=unused", *overrides])
    return KernelShapes(label=label, batch=config.train.micro_batch_size, model=config.model)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--only",
        action="append",
        metavar="KERNEL",
        help="benchmark only these kernels (repeatable; default every kernel of the table)",
    )
    parser.add_argument(
        "--preset",
        action="append",
        help="take shapes from these presets (repeatable; default 125m and 1b)",
    )
    parser.add_argument(
        "--mode",
        action="append",
        metavar="{fwd,fwd+bwd}",
        help="forward only or forward+backward (repeatable; default both)",
    )
    parser.add_argument(
        "--layers",
        metavar="VARIANTS",
        help="also each variant's decoder layers against the baseline design's, time and "
        "memory per layer (t2train/bench/layer_cost.py): comma-separated <design> or "
        "<design>+<mixer>, 'all' (every design, alone and with the mixer) or 'none'; "
        "default 'all', or 'none' with --only",
    )
    parser.add_argument("--json", type=Path, help="also write every row here (JSON)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="on the CPU (Triton interpreter, fp32) at tiny shapes: proves the cases run, "
        "times nothing meaningful",
    )


def register(tools) -> None:
    """``t2train bench kernels``."""
    kernels = tools.add_parser(
        "kernels",
        help="each fused Triton kernel against eager, torch.compile and its peers",
        description=__doc__.split("\n\n")[0].replace("``", ""),
    )
    add_arguments(kernels)
    kernels.set_defaults(handler=run)


def main(argv=None) -> int:
    """``python -m t2train.bench.kernels``, the same as ``t2train bench kernels``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Every case at every preset's shapes, nothing skipped for time."""
    if args.dry_run:  # before any kernel's module is imported: Triton reads it then
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Imported here: `t2train --help` builds this command's parser without torch.
    import torch

    from t2train.bench import kernel_cases as bench
    from t2train.bench import layer_cost
    from t2train.bench.table import markdown_table
    from t2train.bench.variants import all_variants
    from t2train.kernels.benchmark import Runtime
    from t2train.residual import kernel_benchmarks

    known = kernel_benchmarks()
    variants = all_variants()
    asked_layers = args.layers or ("none" if args.only else "all")
    layers = {"all": variants, "none": []}.get(asked_layers, asked_layers.split(","))
    for flag, asked, valid in (
        ("--only", args.only, known),
        ("--mode", args.mode, bench.MODES),
        ("--layers", layers, variants),
    ):
        unknown = sorted(set(asked or ()) - set(valid))
        if unknown:
            raise SystemExit(f"error: {flag} {', '.join(unknown)}: one of {', '.join(valid)}")
    if args.dry_run:
        rt = Runtime("cpu", torch.float32)
        presets: list[tuple[str, str, tuple[str, ...]]] = [("tiny", "tiny", DRY_RUN_SHAPE)]
        header = "# Kernel benchmark: CPU dry run (Triton interpreter, fp32)\n"
    elif not torch.cuda.is_available():
        print(
            "t2train.bench.kernels: no CUDA device, nothing to benchmark (--dry-run runs "
            "the cases on the CPU)"
        )
        return 0
    else:
        import triton

        rt = Runtime()
        presets = [(name, name, ()) for name in args.preset or ["125m", "1b"]]
        header = (
            f"# Kernel benchmark: {torch.cuda.get_device_name()}, torch "
            f"{torch.__version__}, triton {triton.__version__}, {datetime.date.today()}\n"
            f"\nDevice copy bandwidth: {bench.copy_bandwidth_gbs():.0f} GB/s\n"
        )
    torch.manual_seed(0)
    print(header, flush=True)
    rows, started = [], time.monotonic()
    for label, preset, overrides in presets:
        for case in bench.cases(preset_shapes(label, preset, overrides), rt, args.only):
            case_started = time.monotonic()
            rows += bench.run_case(case, rt, args.mode or bench.MODES)
            print(
                f"{case.kernel} {case.preset} {case.shape}: "
                f"{time.monotonic() - case_started:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            if rt.on_cuda:
                torch.cuda.empty_cache()
    print(markdown_table(bench.TABLE_HEADER, [bench.table_cells(row) for row in rows]))
    costs = []
    for label, preset, overrides in presets if layers else []:
        costs += layer_cost.layer_costs(label, preset, overrides, layers, rt)
    if costs:
        print(f"\n## Decoder layers against {layer_cost.BASELINE}'s\n")
        print(markdown_table(layer_cost.TABLE_HEADER, [layer_cost.table_cells(c) for c in costs]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "header": header.strip(),
                    "seconds": time.monotonic() - started,
                    "rows": [bench.row_dict(row) for row in rows],
                    "layers": [layer_cost.row_dict(cost) for cost in costs],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
