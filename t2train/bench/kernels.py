"""``python -m t2train.bench.kernels``: the Triton kernels against their peers at preset shapes,
and the GPU check's kernel section.

Shapes: one micro-batch of the preset (sequence, width, heads, query groups), with the design
options of ``targets.yaml`` (ShortSWA window, depth_attn window, DDL widths d_v, Block AttnRes
block size; the largest Block AttnRes read has one source per completed block). On the GPU in
bf16 against eager, ``torch.compile`` and FlexAttention; in the check's dry run in fp32 on the
CPU with the Triton interpreter (its bf16 ``tl.dot`` is wrong) and dynamo's eager backend,
which only proves the harness runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

from t2train.bench import kernel_cases as bench
from t2train.bench.gpu.plan import Plan, load_settings

CHECK_MODE = "fwd+bwd"


def preset_shapes(label: str, preset: str, overrides, options: dict):
    from t2train.config.loader import load_config

    config = load_config(preset, None, ["data.path=unused", *overrides])
    model, train = config.model, config.train
    return bench.KernelShapes(
        label=label,
        batch=train.micro_batch_size,
        seq=model.seq_length,
        hidden=model.hidden_size,
        heads=model.num_attention_heads,
        kv_heads=model.num_query_groups or model.num_attention_heads,
        window=options["window"],
        depth_window=options["depth_window"],
        ddl_widths=tuple(options["ddl_widths"]),
        sources=2 * model.num_layers // options["block_size"],
        block=options["block_size"],
    )


def run(section, plan: Plan) -> None:
    import torch

    rt = (
        bench.Runtime("cpu", torch.float32)
        if plan.dry_run
        else bench.Runtime("cuda", torch.bfloat16)
    )
    section.data.update(
        mode=CHECK_MODE,
        dtype=str(rt.dtype).removeprefix("torch."),
        header=bench.TABLE_HEADER,
        shapes={},
    )
    torch.manual_seed(0)
    for label, preset, overrides in plan.kernel_presets:
        shapes = preset_shapes(label, preset, overrides, plan.kernel_options)
        section.data["shapes"][label] = vars(shapes) | {"ddl_widths": list(shapes.ddl_widths)}
        for case in bench.cases(shapes, rt):
            estimate = section.next_item_seconds(default=30.0)
            if not section.fits(estimate):
                section.add(
                    {
                        "kernel": case.kernel,
                        "preset": label,
                        "shape": case.shape,
                        "status": "skipped",
                        "reason": section.no_time(estimate),
                    }
                )
                continue
            started = time.monotonic()
            rows = [bench.row_dict(row) for row in bench.run_case(case, rt, [CHECK_MODE])]
            failed = [row["error"] for row in rows if row["impl"] == "triton" and row["error"]]
            section.add(
                {
                    "kernel": case.kernel,
                    "preset": label,
                    "shape": case.shape,
                    "status": "error" if failed else "ok",
                    "rows": rows,
                    "reason": f"the Triton kernel failed: {failed[0]}" if failed else "",
                    "seconds": time.monotonic() - started,
                }
            )
            if rt.on_cuda:
                torch.cuda.empty_cache()


def main(argv=None) -> int:
    """Every case at every preset's shapes, nothing skipped for time: the GPU window's separate
    invocation for the kernel rows the check's section has no time for (docs/gpu/README.md)."""
    import torch

    from t2train.bench.table import markdown_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        choices=list(bench.BUILDERS),
        action="append",
        help="benchmark only these kernels (repeatable)",
    )
    parser.add_argument(
        "--preset",
        action="append",
        help="take shapes from these presets (repeatable; default 125m and 1b)",
    )
    parser.add_argument(
        "--mode",
        choices=bench.MODES,
        action="append",
        help="forward only or forward+backward (default both)",
    )
    parser.add_argument("--json", type=Path, help="also write every row here (JSON)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="on the CPU (Triton interpreter, fp32) at the check's dry-run "
        "shapes: proves the cases run, times nothing meaningful",
    )
    args = parser.parse_args(argv)
    settings = load_settings()
    if args.dry_run:
        rt, options = bench.Runtime("cpu", torch.float32), settings.dry_run_kernel_options
        presets = [
            (
                "tiny",
                "tiny",
                (*settings.dry_run_overrides, "model.seq_length=8", "train.micro_batch_size=1"),
            )
        ]
        header = "# Kernel benchmark: CPU dry run (Triton interpreter, fp32)\n"
    elif not torch.cuda.is_available():
        print(
            "t2train.bench.kernels: no CUDA device, nothing to benchmark (--dry-run runs "
            "the cases on the CPU)"
        )
        return 0
    else:
        import triton

        rt, options = bench.Runtime(), settings.kernel_options
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
        for case in bench.cases(preset_shapes(label, preset, overrides, options), rt, args.only):
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
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "header": header.strip(),
                    "seconds": time.monotonic() - started,
                    "rows": [bench.row_dict(row) for row in rows],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
