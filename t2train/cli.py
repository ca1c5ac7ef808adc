"""The ``t2train`` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from t2train.config.arguments import CONFIG_SECTIONS, add_config_arguments
from t2train.residual import registered

TRAIN_EPILOG = f"""\
overrides are dotted config fields, e.g.:
  model.residual={"|".join(registered())} model.num_layers=4
  train.steps=300 data.path=DIR parallel.tensor=2 parallel.pipeline=2
  name=RUN (outputs go to log.run_dir, runs/{{name}} by default) checkpoint.resume=auto|none|PATH
config sections: {", ".join(CONFIG_SECTIONS)}
  (every field and its meaning: t2train config --list [SECTION]; t2train config --preset P
  prints a resolved config)
run under torchrun for several processes: t2train launch --nproc-per-node=2 ...
"""


def _load(args):
    from t2train.config.loader import load_config

    return load_config(args.preset, args.config, args.overrides)


def _cmd_train(args) -> int:
    from t2train.train.inputs import dataset_facts

    config = _load(args)  # a config or dataset error answers before torch is imported
    dataset_facts(config)
    from t2train.export.on_finish import export_on_finish
    from t2train.parallel.init import is_rank_zero
    from t2train.signals import REQUEUE_EXIT_CODE
    from t2train.train.loop import train

    if args.dry_run:
        return _dry_run(config)
    summary = train(config)
    if summary.final_save_failed:
        from t2train.checkpoint.manager import SAVE_FAILED_EXIT_CODE

        if is_rank_zero():
            print(
                f"error: the checkpoint of the last step {summary.final_step} was not saved "
                f"(see the warning above); the newest published checkpoint is "
                f"{summary.checkpoint or 'none'}; exit code {SAVE_FAILED_EXIT_CODE}",
                file=sys.stderr,
            )
        return SAVE_FAILED_EXIT_CODE
    if is_rank_zero():
        print(_outcome(summary, REQUEUE_EXIT_CODE))
        if not summary.stopped:
            print(_next_commands(summary.run_dir, config.data.path))
    exported = export_on_finish(config, summary)
    if exported is not None:
        print(f"exported the final checkpoint for Hugging Face transformers to {exported}")
    return REQUEUE_EXIT_CODE if summary.stopped else 0


def _outcome(summary, requeue_code: int) -> str:
    """The run's last line: stopped early (and how to go on), or done with its val losses."""
    if summary.stopped:
        return (
            f"stopped early at step {summary.final_step} ({summary.stopped}): checkpoint "
            f"{summary.checkpoint} saved; run the same command again to resume (exit code "
            f"{requeue_code})"
        )
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


def _dry_run(config) -> int:
    """Set everything up, read one step of data, print what would run; train nothing."""
    from t2train.bench.plan import format_plan, plan_layout
    from t2train.parallel.init import is_rank_zero
    from t2train.residual import variant_label
    from t2train.train.dry_run import dry_run

    checked = dry_run(config)
    if not is_rank_zero():
        return 0
    parallel, steps = config.parallel, config.train.steps
    epochs = steps * config.train.global_batch_size / checked.samples["train"]
    start = (
        f"resume from {checked.resume_from}{checked.skipped} (verified, not loaded now)"
        if checked.resume_from
        else f"fresh start from the weights of {checked.init_from} (verified, not loaded now)"
        if checked.init_from
        else "fresh start"
    )
    print(
        f"dry run of {config.run_dir}: {variant_label(config.model)} residual, "
        f"{checked.parameters / 1e6:.2f}M parameters on rank 0 | world {checked.world_size} = "
        f"TP {parallel.tensor} x PP {parallel.pipeline} x DP {checked.data_parallel} | "
        f"engine {config.train.engine} | {start}\n"
        f"data {config.data.path}: {checked.samples['train']:,} training and "
        f"{checked.samples['val']:,} validation samples; {steps:,} steps of "
        f"{checked.tokens_per_step:,} tokens = {epochs:.2f} epochs; one step's batches read"
    )
    print(
        format_plan(
            config,
            plan_layout(config, checked.vocab_size, checked.world_size),
            "the dataset's tokenizer" if not config.model.vocab_size else "model.vocab_size",
            None,
        )
    )
    print("nothing trained or written; to train, run the same command without --dry-run")
    return 0


def _next_commands(run_dir, data: str) -> str:
    """What one does with a finished run."""
    return (
        f"next: t2train generate {run_dir} --prompt TEXT | t2train eval {run_dir} --data "
        f"{data} | t2train export hf {run_dir} OUT | tensorboard --logdir {run_dir.parent}"
    )


def _cmd_launch(args) -> int:
    from t2train.launch.launcher import launch

    return launch(args)


VOCAB_DEFAULT = 32000  # `t2train plan` without model.vocab_size or --vocab-size


def _cmd_plan(args) -> int:
    from t2train.bench.plan import format_plan, plan_layout, planned_for_gpu
    from t2train.config.loader import load_config

    given = load_config(args.preset, args.config, args.overrides)
    config = planned_for_gpu(given)
    if config.model.vocab_size:
        vocab, source = config.model.vocab_size, "model.vocab_size"
    else:
        vocab = args.vocab_size
        source = (
            "--vocab-size"
            if args.vocab_size != VOCAB_DEFAULT
            else "--vocab-size default; training takes the dataset's"
        )
    world = args.world_size or config.parallel.tensor * config.parallel.pipeline
    note = (
        " (train.precision=auto plans a GPU run; train.precision=fp32 plans fp32)"
        if given.train.precision == "auto"
        else ""
    )
    print(
        format_plan(
            config,
            plan_layout(config, vocab, world),
            source,
            int(args.device_memory_gib * 2**30),
            note,
        )
    )
    return 0


def _cmd_config(args) -> int:
    from t2train.errors import UserInputError

    if args.list is not None:
        return _list_config_fields(args)
    if args.markdown:
        raise UserInputError("config --markdown goes with --list: t2train config --list --markdown")
    from t2train.config.loader import dump_config

    config = _load(args)
    if config.data.path:  # a dataset that is not there (or does not fit) fails here too
        from t2train.train.inputs import dataset_facts

        dataset_facts(config)
    print(dump_config(config), end="")
    return 0


def _list_config_fields(args) -> int:
    """``t2train config --list [SECTION]``: every field (under SECTION) with its type,
    default and meaning, from the dataclasses (``t2train/config/reference.py``)."""
    from t2train.config.reference import format_listing, format_markdown, reference, select
    from t2train.errors import UserInputError

    if args.preset or args.config or args.overrides:
        given = args.preset or args.config or args.overrides[0]
        raise UserInputError(
            f"config --list lists the fields and their defaults; it takes no preset, config "
            f"file or override (got {given!r}): t2train config --list [SECTION]"
        )
    sections = select(reference(), args.list)
    print(format_markdown(sections) if args.markdown else format_listing(sections), end="")
    return 0


class _VersionAction(argparse.Action):
    """``--version``: the line is built only when asked (it runs git)."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from t2train.version import version_line

        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """Every command and option; imports nothing heavy (no torch, no Megatron), so ``--help``
    is fast: a command's module imports those when it runs (tests/test_cli.py checks)."""
    from t2train.bench.compare import register as register_compare
    from t2train.bench.step import register as register_bench
    from t2train.checkpoint.inspect import register as register_ckpt
    from t2train.data.cli import register as register_data
    from t2train.export.cli import register as register_export
    from t2train.export.cli import register_convert
    from t2train.launch.launcher import LAUNCH_EPILOG
    from t2train.launch.launcher import add_arguments as add_launch_arguments

    parser = argparse.ArgumentParser(
        prog="t2train",
        description="Pretrain decoder Transformers with pluggable residual streams "
        "(Megatron-core TP/PP, mosaicml-streaming data, TensorBoard).",
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="print t2train's version (and commit) and its stack's, then exit",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser(
        "train",
        help="train a model (single process, or one rank under torchrun)",
        description="Train from a preset/YAML plus overrides; resumes from the newest "
        "checkpoint of the run directory by default.",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(train)
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config, data and layout, build the model and read one "
        "step of data, print the plan, and stop: nothing is trained or "
        "written",
    )
    train.set_defaults(handler=_cmd_train)

    show = commands.add_parser(
        "config",
        help="print the resolved, validated config as YAML; --list: every field and its meaning",
    )
    add_config_arguments(show)
    show.add_argument(
        "--list",
        nargs="?",
        const="",
        metavar="SECTION",
        help="list every config field (or those under SECTION, e.g. model.ddl) with its type, "
        "allowed values, default and meaning, instead of printing a config (docs/config.md)",
    )
    show.add_argument(
        "--markdown",
        action="store_true",
        help="with --list: as Markdown, as docs/config.md holds it",
    )
    show.set_defaults(handler=_cmd_config)

    plan = commands.add_parser(
        "plan",
        help="per pipeline stage: parameters, memory, depth cache, bytes per hop",
        description="Estimate what a layout puts on each pipeline stage (parameters, "
        "activation and depth-cache memory) and the exact bytes of each pipeline "
        "hop, naive vs cached, without running anything.",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(plan)
    plan.add_argument("--world-size", type=int, help="processes (default TP x PP, i.e. DP = 1)")
    plan.add_argument(
        "--vocab-size",
        type=int,
        default=VOCAB_DEFAULT,
        help=f"vocabulary when model.vocab_size is unset (default "
        f"{VOCAB_DEFAULT}; training takes the dataset's)",
    )
    plan.add_argument(
        "--device-memory-gib",
        type=float,
        default=80.0,
        help="memory of one GPU, for the per-GPU totals (default 80, an H100)",
    )
    plan.set_defaults(handler=_cmd_plan)

    launch = commands.add_parser(
        "launch",
        help="train under torchrun: one machine, or each node of a SLURM job step",
        description="Run `t2train train` under torchrun. Inside a SLURM job step (srun, one "
        "task per node) the nodes, node rank and c10d rendezvous come from SLURM; "
        "otherwise it runs standalone on this machine. Prints the topology first.",
        epilog=LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launch_arguments(launch)
    add_config_arguments(launch)
    launch.set_defaults(handler=_cmd_launch)

    register_data(commands)
    register_convert(register_ckpt(commands))
    register_bench(commands)
    register_compare(commands)
    register_export(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from t2train.errors import TrainingHalted, UserInputError

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the usage of the command that was given, not the top-level one
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.handler(args)
    except (UserInputError, TrainingHalted) as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:  # Ctrl-C (in training, the second one: the first saves)
        print(
            f"t2train {args.command}: interrupted by Ctrl-C"
            f"{INTERRUPTED.get(args.command, '')} (exit code {INTERRUPTED_EXIT_CODE})",
            file=sys.stderr,
        )
        return INTERRUPTED_EXIT_CODE


def _command_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The (sub)command's parser ``args`` came through, e.g. ``t2train data prepare``'s."""
    while True:
        commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, commands[0].dest, None) if commands else None
        if chosen is None:
            return parser
        parser = commands[0].choices[chosen]


INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports it
INTERRUPTED = {"train": ", without saving: the run continues from its last checkpoint"}


if __name__ == "__main__":
    sys.exit(main())
