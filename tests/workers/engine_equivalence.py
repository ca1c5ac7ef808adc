"""Train one design with the Megatron engine and with DeepSpeed ZeRO-1/2/3 (DP = world).

``--phase straight``: each engine trains from scratch for STEPS steps, saving at SAVE_AT.
``--phase resume`` (a fresh process): each ZeRO run resumes from its SAVE_AT checkpoint,
and a ZeRO-2 run is pointed at the ZeRO-1 checkpoint (refused: another layout).
Writes {run: {step: loss}}; runs are named ``megatron`` and ``zero1`` .. ``zero3``; the
refusal's message is under ``refused``.
"""

from __future__ import annotations

from pathlib import Path

from common import parse_args, write_result

from t2train.checkpoint.errors import CheckpointError
from t2train.config.loader import load_config
from t2train.train.loop import train

STEPS, SAVE_AT = 5, 3
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=8",
        "train.lr=3e-3", "train.min_lr=3e-4", "train.warmup_steps=2", "train.eval_batches=1",
        "train.log_interval=1", "log.diagnostics_interval=2", f"train.steps={STEPS}",
        f"checkpoint.interval={SAVE_AT}"]
ENGINES = {"megatron": ["train.engine=megatron"],
           **{f"zero{stage}": ["train.engine=deepspeed", f"deepspeed.zero_stage={stage}"]
              for stage in (1, 2, 3)}}


def main() -> None:
    args = parse_args([("--data", Path), ("--root", Path), ("--phase", str),
                       ("--design", str)])
    losses = {}
    for name, engine in ENGINES.items():
        run_dir = args.root / name
        common = [*TINY, *engine, f"model.residual={args.design}", f"data.path={args.data}"]
        if args.phase == "straight":
            run = [f"log.run_dir={run_dir}", "checkpoint.resume=none"]
        elif name == "megatron":
            continue
        else:
            run = [f"log.run_dir={args.root / (name + '-resumed')}",
                   f"checkpoint.resume={run_dir / 'checkpoints' / f'step_{SAVE_AT:08d}'}"]
        losses[name] = train(load_config(overrides=[*common, *run])).losses
    if args.phase == "resume":
        zero1 = args.root / "zero1" / "checkpoints" / f"step_{SAVE_AT:08d}"
        try:
            train(load_config(overrides=[*TINY, *ENGINES["zero2"], f"data.path={args.data}",
                                         f"model.residual={args.design}",
                                         f"log.run_dir={args.root / 'zero2-from-zero1'}",
                                         f"checkpoint.resume={zero1}"]))
        except CheckpointError as err:
            losses["refused"] = str(err)
    write_result(args.out, losses)


if __name__ == "__main__":
    main()
