"""The ``t2train`` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from t2train.config.arguments import CONFIG_SECTIONS, add_config_arguments
from t2train.residual import registered

TRAIN_EPILOG = f"""\
overrides are dotted config fields, e.g.:
  model.residual={'|'.join(registered())} model.num_layers=4
  train.steps=300 data.path=DIR parallel.tensor=2 parallel.pipeline=2
  name=RUN (outputs go to log.run_dir, runs/{{name}} by default) checkpoint.resume=auto|none|PATH
config sections: {', '.join(CONFIG_SECTIONS)}
  (every field with its rule: t2train/config/schema.py; t2train config --preset P prints one)
run under torchrun for several processes: t2train launch --nproc-per-node=2 ...
"""


def _load(args):
    from t2train.config.loader import load_config

    return load_config(args.preset, args.config, args.overrides)


def _cmd_train(args) -> int:
    from t2train.export.on_finish import export_on_finish
    from t2train.parallel.init import is_rank_zero
    from t2train.signals import REQUEUE_EXIT_CODE
    from t2train.train.loop import train

    config = _load(args)
    summary = train(config)
    if summary.final_save_failed:
        from t2train.checkpoint.manager import SAVE_FAILED_EXIT_CODE

        if is_rank_zero():
            print(f"error: the checkpoint of the last step {summary.final_step} was not saved "
                  f"(see the warning above); the newest published checkpoint is "
                  f"{summary.checkpoint or 'none'}; exit code {SAVE_FAILED_EXIT_CODE}",
                  file=sys.stderr)
        return SAVE_FAILED_EXIT_CODE
    if is_rank_zero():
        print(_outcome(summary, REQUEUE_EXIT_CODE))
    exported = export_on_finish(config, summary)
    if exported is not None:
        print(f"exported the final checkpoint for Hugging Face transformers to {exported}")
    return REQUEUE_EXIT_CODE if summary.stopped else 0


def _outcome(summary, requeue_code: int) -> str:
    """The run's last line: stopped early (and how to go on), or done with its val losses."""
    if summary.stopped:
        return (f"stopped early at step {summary.final_step} ({summary.stopped}): checkpoint "
                f"{summary.checkpoint} saved; run the same command again to resume (exit code "
                f"{requeue_code})")
    done = f"done: step {summary.final_step}"
    if summary.val_losses:
        steps = sorted(summary.val_losses)
        first, last = steps[0], steps[-1]
        done += f", val loss {summary.val_losses[first]:.4f} (step {first})"
        if last != first:
            done += f" -> {summary.val_losses[last]:.4f} (step {last})"
        if summary.start_step:
            done += f", this run resumed at step {summary.start_step}"
    return f"{done}; run dir {summary.run_dir}"


def _cmd_launch(args) -> int:
    from t2train.launch.launcher import launch

    return launch(args)


VOCAB_DEFAULT = 32000  # `t2train plan` without model.vocab_size or --vocab-size


def _cmd_plan(args) -> int:
    from t2train.config.loader import load_config
    from t2train.bench.plan import format_plan, plan_layout

    config = load_config(args.preset, args.config, args.overrides)
    if config.model.vocab_size:
        vocab, source = config.model.vocab_size, "model.vocab_size"
    else:
        vocab = args.vocab_size
        source = "--vocab-size" if args.vocab_size != VOCAB_DEFAULT else \
            "--vocab-size default; training takes the dataset's"
    world = args.world_size or config.parallel.tensor * config.parallel.pipeline
    print(format_plan(config, plan_layout(config, vocab, world), source,
                      int(args.device_memory_gib * 2 ** 30)))
    return 0


def _cmd_config(args) -> int:
    from t2train.config.loader import dump_config

    print(dump_config(_load(args)), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from t2train.bench.compare import register as register_compare
    from t2train.bench.step import register as register_bench
    from t2train.checkpoint.inspect import register as register_ckpt
    from t2train.data.cli import register as register_data
    from t2train.export.cli import register as register_export
    from t2train.launch.launcher import LAUNCH_EPILOG, add_arguments as add_launch_arguments

    parser = argparse.ArgumentParser(
        prog="t2train",
        description="Pretrain decoder Transformers with pluggable residual streams "
                    "(Megatron-core TP/PP, mosaicml-streaming data, TensorBoard).")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser(
        "train", help="train a model (single process, or one rank under torchrun)",
        description="Train from a preset/YAML plus overrides; resumes from the newest "
                    "checkpoint of the run directory by default.",
        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(train)
    train.set_defaults(handler=_cmd_train)

    show = commands.add_parser("config", help="print the resolved, validated config as YAML")
    add_config_arguments(show)
    show.set_defaults(handler=_cmd_config)

    plan = commands.add_parser(
        "plan", help="per pipeline stage: parameters, memory, depth cache, bytes per hop",
        description="Estimate what a layout puts on each pipeline stage (parameters, "
                    "activation and depth-cache memory) and the exact bytes of each pipeline "
                    "hop, naive vs cached, without running anything.",
        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(plan)
    plan.add_argument("--world-size", type=int, help="processes (default TP x PP, i.e. DP = 1)")
    plan.add_argument("--vocab-size", type=int, default=VOCAB_DEFAULT,
                      help=f"vocabulary when model.vocab_size is unset (default "
                           f"{VOCAB_DEFAULT}; training takes the dataset's)")
    plan.add_argument("--device-memory-gib", type=float, default=80.0,
                      help="memory of one GPU, for the per-GPU totals (default 80, an H100)")
    plan.set_defaults(handler=_cmd_plan)

    launch = commands.add_parser(
        "launch", help="train under torchrun: one machine, or each node of a SLURM job step",
        description="Run `t2train train` under torchrun. Inside a SLURM job step (srun, one "
                    "task per node) the nodes, node rank and c10d rendezvous come from SLURM; "
                    "otherwise it runs standalone on this machine. Prints the topology first.",
        epilog=LAUNCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(launch)
    add_config_arguments(launch)
    launch.set_defaults(handler=_cmd_launch)

    register_data(commands)
    register_ckpt(commands)
    register_bench(commands)
    register_compare(commands)
    register_export(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from t2train.errors import TrainingHalted, UserInputError

    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (UserInputError, TrainingHalted) as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
