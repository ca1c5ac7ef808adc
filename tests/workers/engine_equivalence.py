"""Train designs with the Megatron engine and with DeepSpeed ZeRO-1/2/3 (DP = world).

``--phase straight``: for each of ``--designs``, each engine trains from scratch for STEPS
steps, saving at SAVE_AT. ``--phase resume`` (a fresh process): each ZeRO run of the first
design resumes from its SAVE_AT checkpoint, and a ZeRO-2 run is pointed at the ZeRO-1
checkpoint (refused: another layout). Writes {design: {run: {step: loss}}}, runs named
``megatron`` and ``zero1`` .. ``zero3``; the refusal's message is under ``refused``.

``--phase init`` (a fresh process): runs of the last design start from the weights of the
newest checkpoint of another run (``checkpoint.init_from``) in another engine or layout, each saving
them again as its step 0 (``START_FROM``: run -> source run, engine and layout). One process
runs them all, so each ``train()`` also sets up another layout than the one before it did.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from common import finish, parse_args, write_result

from t2train.checkpoint.errors import CheckpointError
from t2train.config.loader import load_config
from t2train.engine.deepspeed.engine import DeepSpeedEngine
from t2train.train.loop import train

STEPS, SAVE_AT = 5, 3
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.lr=3e-3",
    "train.min_lr=3e-4",
    "train.warmup_steps=2",
    "train.eval_batches=1",
    "train.log_interval=1",
    "log.diagnostics_interval=2",
    f"train.steps={STEPS}",
    f"checkpoint.interval={SAVE_AT}",
]
ENGINES = {
    "megatron": ["train.engine=megatron"],
    **{
        f"zero{stage}": ["train.engine=deepspeed", f"deepspeed.zero_stage={stage}"]
        for stage in (1, 2, 3)
    },
}


START_FROM = {
    "zero3-tp2-from-megatron": ("megatron", [*ENGINES["zero3"], "parallel.tensor=2"]),
    "megatron-pp2-from-zero3": ("zero3", [*ENGINES["megatron"], "parallel.pipeline=2"]),
    "zero1-tp2-from-zero3": ("zero3", [*ENGINES["zero1"], "parallel.tensor=2"]),
    # the checkpoint's TP size: each rank reads only its own tensor-parallel rank's files
    "zero2-tp2-from-zero1-tp2": ("zero1-tp2-from-zero3", [*ENGINES["zero2"], "parallel.tensor=2"]),
    # another vocabulary padding (1024 rows to 1056): the real rows kept, the padding rows zero
    "megatron-vocab96-from-zero3": (
        "zero3",
        [*ENGINES["megatron"], "model.make_vocab_size_divisible_by=96"],
    ),
}


def _checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / f"step_{SAVE_AT:08d}"


def _save_with_arbitrary_padding(save):
    """ZeRO-3 pads a parameter's last partition with uninitialised memory (NaN by chance):
    written NaN here before every save, it must not count as the model's state."""

    def saving(engine, *args, **kwargs):
        for param in engine.ds.module.parameters():
            if getattr(param, "ds_tensor", None) is not None and _padded(param):
                param.ds_tensor[-1] = float("nan")  # the partition's last element: padding
        return save(engine, *args, **kwargs)

    return saving


def _padded(param) -> bool:
    """Whether this rank's partition of ``param`` ends in padding."""
    part = param.ds_tensor
    return part.ds_numel * (dist.get_rank(group=param.ds_process_group) + 1) > param.ds_numel


def main() -> None:
    DeepSpeedEngine.save = _save_with_arbitrary_padding(DeepSpeedEngine.save)
    args = parse_args([("--data", Path), ("--root", Path), ("--phase", str), ("--designs", str)])
    designs = args.designs.split(",")
    if args.phase == "init":
        write_result(args.out, _start_from_other_runs(args.root, designs[-1], args.data))
        return
    if args.phase == "resume":
        designs = designs[:1]
    result = {}
    for design in designs:
        common = [*TINY, f"model.residual={design}", f"data.path={args.data}"]
        losses = result[design] = {}
        for name, engine in ENGINES.items():
            run_dir = args.root / design / name
            if args.phase == "straight":
                run = [f"log.run_dir={run_dir}", "checkpoint.resume=none"]
            elif name == "megatron":
                continue
            else:
                run = [
                    f"log.run_dir={run_dir}-resumed",
                    f"checkpoint.resume={_checkpoint(run_dir)}",
                ]
            losses[name] = train(load_config(overrides=[*common, *engine, *run])).losses
        if args.phase == "resume":
            try:
                train(
                    load_config(
                        overrides=[
                            *common,
                            *ENGINES["zero2"],
                            f"log.run_dir={args.root / 'zero2-from-zero1'}",
                            f"checkpoint.resume={_checkpoint(args.root / design / 'zero1')}",
                        ]
                    )
                )
            except CheckpointError as err:
                result["refused"] = str(err)
    write_result(args.out, result)


def _start_from_other_runs(root: Path, design: str, data: Path) -> dict:
    losses = {}
    for run, (source, engine) in START_FROM.items():
        config = [
            *TINY,
            f"model.residual={design}",
            f"data.path={data}",
            *engine,
            f"log.run_dir={root / design / run}",
            f"checkpoint.init_from={root / design / source}",  # its newest checkpoint
            "checkpoint.save_on_resume=true",
            "train.steps=2",
            "train.warmup_steps=1",
        ]
        losses[run] = train(load_config(overrides=config)).losses
    return losses


if __name__ == "__main__":
    main()
    finish()
