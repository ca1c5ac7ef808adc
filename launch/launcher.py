"""``t2train launch``: training under torchrun on one machine or on every node of a SLURM step.

Everything that can fail without starting a process (config, SLURM variables, devices,
rendezvous port, layout against the world size) is checked first, so a bad launch ends
with one ``error:`` line instead of a hung rendezvous.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from t2train.launch.plan import JOIN_TIMEOUT, RESTART_TIMEOUT

LAUNCH_EPILOG = """\
examples:
  t2train launch --nproc-per-node=2 --preset tiny data.path=DIR parallel.tensor=2
  srun --ntasks-per-node=1 t2train launch --preset 1b data.path=DIR   (one task per node)
inside a SLURM job step the node count, node rank and rendezvous point come from SLURM and
processes per node default to the node's GPUs (SLURM_GPUS_ON_NODE, else visible CUDA devices).
exit code 75: the trainer saved a checkpoint and stopped early (signal or --exit-duration);
run the same command again to resume (slurm/pretrain.sbatch requeues itself).
exit code 74: the run ended but its last checkpoint could not be written
(checkpoint.on_save_error=continue); 3: stopped by a failure (the error line names it).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="processes per node (default: GPUs of the node; required on CPU)",
    )
    parser.add_argument(
        "--port",
        type=int,
        help="c10d rendezvous port (default: free port; under SLURM derived from the job id)",
    )
    parser.add_argument(
        "--standalone", action="store_true", help="one machine, even inside a SLURM allocation"
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="when a worker fails (crash, kill, collective timeout), restart "
        "the node's workers up to N times; each restart resumes from the "
        "newest checkpoint (checkpoint.resume=auto). Every node restarts "
        "(each node's launcher needs it). Default 0",
    )
    parser.add_argument(
        "--join-timeout",
        type=float,
        default=JOIN_TIMEOUT,
        metavar="SECONDS",
        help="how long the start waits for every node's launcher to join the "
        f"rendezvous; then the node stops with one error line (default {JOIN_TIMEOUT:.0f})",
    )
    parser.add_argument(
        "--restart-timeout",
        type=float,
        default=RESTART_TIMEOUT,
        metavar="SECONDS",
        help="how long a restart waits for every node to restart too; then "
        f"the node exits with its workers' code (default "
        f"{RESTART_TIMEOUT:.0f})",
    )
    parser.add_argument(
        "--exit-duration",
        type=float,
        metavar="MINUTES",
        help="save and stop (exit 75) after this many minutes of training; "
        "sets train.exit_duration_mins",
    )


def overrides(args: argparse.Namespace) -> list[str]:
    """The dotted overrides, with ``--exit-duration`` as the config field it sets."""
    extra = [] if args.exit_duration is None else [f"train.exit_duration_mins={args.exit_duration}"]
    return [*args.overrides, *extra]


def train_argv(args: argparse.Namespace) -> list[str]:
    """The ``t2train train`` arguments every worker gets."""
    argv = ["--preset", args.preset] if args.preset else []
    argv += ["--config", args.config] if args.config else []
    return argv + overrides(args)


def launch(args: argparse.Namespace) -> int:
    from t2train.config.loader import load_config
    from t2train.launch import slurm_env
    from t2train.run_lock import RunDirectoryInUse, check_not_in_use

    config = load_config(args.preset, args.config, overrides(args))
    step = (
        None
        if args.standalone or not slurm_env.in_slurm_job(os.environ)
        else slurm_env.read_step(os.environ)
    )
    # A live run directory is refused here, before torch is imported and any worker starts
    # (the trainer's rank 0 still takes the lock); node 0 says why, once for the job.
    try:
        check_not_in_use(Path(config.run_dir))
    except RunDirectoryInUse:
        if step is None or step.node_rank == 0:
            raise
        return RunDirectoryInUse.exit_code

    from t2train.launch import torchrun

    torchrun.quiet_libtorch_warnings()
    import torch

    from t2train.launch import plan as plans
    from t2train.signals import parse_signals

    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = plans.processes_per_node(args.nproc_per_node, step and step.gpus_on_node, cuda_devices)
    plan = (
        plans.plan_slurm(step, nproc, args.port)
        if step
        else plans.plan_standalone(nproc, args.port)
    )
    config.validate_world(plan.world_size)
    print(plan.describe(), flush=True)
    if args.max_restarts < 0:
        raise plans.LaunchError(f"--max-restarts={args.max_restarts}: must be >= 0")
    for flag, seconds in (("join", args.join_timeout), ("restart", args.restart_timeout)):
        if seconds <= 0:
            raise plans.LaunchError(f"--{flag}-timeout={seconds}: must be > 0")
    return torchrun.run(
        plan,
        train_argv(args),
        parse_signals(config.train.exit_signals),
        args.max_restarts,
        args.restart_timeout,
        args.join_timeout,
    )
