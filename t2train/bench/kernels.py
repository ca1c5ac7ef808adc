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
import sys
import time

from t2train.bench.gpu.plan import Plan, load_settings
from t2train.bench import kernel_cases as bench

CHECK_MODE = "fwd+bwd"


def preset_shapes(label: str, preset: str, overrides, options: dict):
    from t2train.config.loader import load_config

    config = load_config(preset, None, ["data.path=unused", *overrides])
    model, train = config.model, config.train
    return bench.KernelShapes(
        label=label, batch=train.micro_batch_size, seq=model.seq_length, hidden=model.hidden_size,
        heads=model.num_attention_heads,
        kv_heads=model.num_query_groups or model.num_attention_heads, window=options["window"],
        depth_window=options["depth_window"],
        ddl_widths=tuple(options["ddl_widths"]),
        sources=2 * model.num_layers // options["block_size"], block=options["block_size"])


def run(section, plan: Plan) -> None:
    import torch

    rt = (bench.Runtime("cpu", torch.float32) if plan.dry_run
          else bench.Runtime("cuda", torch.bfloat16))
    section.data.update(mode=CHECK_MODE, dtype=str(rt.dtype).removeprefix("torch."),
                        header=bench.TABLE_HEADER, shapes={})
    torch.manual_seed(0)
    for label, preset, overrides in plan.kernel_presets:
        shapes = preset_shapes(label, preset, overrides, plan.kernel_options)
        section.data["shapes"][label] = vars(shapes) | {"ddl_widths": list(shapes.ddl_widths)}
        for case in bench.cases(shapes, rt):
            estimate = section.last_item_seconds(default=30.0)
            if not section.fits(estimate):
                section.add({"kernel": case.kernel, "preset": label, "shape": case.shape,
                             "status": "skipped", "reason": section.no_time(estimate)})
                continue
            started = time.monotonic()
            rows = [bench.row_dict(row) for row in bench.run_case(case, rt, [CHECK_MODE])]
            failed = [row["error"] for row in rows if row["impl"] == "triton" and row["error"]]
            section.add({"kernel": case.kernel, "preset": label, "shape": case.shape,
                         "status": "error" if failed else "ok", "rows": rows,
                         "reason": f"the Triton kernel failed: {failed[0]}" if failed else "",
                         "seconds": time.monotonic() - started})
            if rt.on_cuda:
                torch.cuda.empty_cache()


def main(argv=None) -> int:
    import torch

    from t2train.bench.table import markdown_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(bench.BUILDERS), action="append",
                        help="benchmark only these kernels (repeatable)")
    parser.add_argument("--preset", action="append",
                        help="take shapes from these presets (repeatable; default 125m and 1b)")
    parser.add_argument("--mode", choices=bench.MODES, action="append",
                        help="forward only or forward+backward (default both)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("t2train.bench.kernels: no CUDA device, nothing to benchmark")
        return 0
    import triton

    rt, options = bench.Runtime(), load_settings().kernel_options
    torch.manual_seed(0)
    print(f"# Kernel benchmark: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, {datetime.date.today()}\n")
    print(f"Device copy bandwidth: {bench.copy_bandwidth_gbs():.0f} GB/s\n")
    rows = []
    for preset in args.preset or ["125m", "1b"]:
        for case in bench.cases(preset_shapes(preset, preset, (), options), rt, args.only):
            rows += bench.run_case(case, rt, args.mode or bench.MODES)
            torch.cuda.empty_cache()
    print(markdown_table(bench.TABLE_HEADER, [bench.table_cells(row) for row in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
