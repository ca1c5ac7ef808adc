"""The training run: check inputs, set up ranks, resume, train, evaluate, checkpoint, log.

Everything that can be checked without touching the run directory (config, dataset,
resume target) is checked first, so a bad input never creates or alters a run directory.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch.distributed as dist

from t2train.config.loader import dump_config
from t2train.config.schema import Config, ConfigError
from t2train.errors import RankFailure, TrainingHalted

if TYPE_CHECKING:
    from t2train.parallel.init import Topology
    from t2train.train.preemption import StopGuard
    from t2train.train.watchdog import Watchdog


@dataclass
class RunSummary:
    run_dir: Path
    start_step: int
    final_step: int
    losses: dict = field(default_factory=dict)  # step -> training loss
    val_losses: dict = field(default_factory=dict)  # step -> validation loss
    checkpoint: Optional[Path] = None  # the last saved (the newest published if that failed)
    stopped: Optional[str] = None  # why the run stopped before train.steps (signal, time limit)
    final_save_failed: bool = False  # the save of final_step failed (on_save_error=continue)


def dataset_facts(config: Config) -> dict:
    from t2train.data.prepare import read_index

    if not config.data.path:
        raise ConfigError("data.path='': must name a prepared dataset directory (see "
                          "`t2train data prepare`)")
    index = read_index(config.data.path)
    if config.model.seq_length > index["seq_length"]:
        raise ConfigError(f"model.seq_length={config.model.seq_length}: longer than the "
                          f"dataset's samples ({index['seq_length']} tokens) in {config.data.path}")
    vocab = config.model.vocab_size or index["vocab_size"]
    if vocab < index["vocab_size"]:
        raise ConfigError(f"model.vocab_size={vocab}: smaller than the tokenizer's vocabulary "
                          f"({index['vocab_size']}) of {config.data.path}")
    return {"vocab_size": vocab, "tokenizer_sha256": index["tokenizer"]["sha256"]}


def _resume_target(config: Config, run_dir: Path) -> Optional[Path]:
    """Which checkpoint to start from, decided before anything is written."""
    from t2train.checkpoint.paths import is_complete
    from t2train.checkpoint.store import find_latest

    resume = config.checkpoint.resume
    if resume == "auto":
        return find_latest(run_dir / "checkpoints")
    if resume == "none":
        if run_dir.exists() and any(run_dir.iterdir()) and not config.checkpoint.overwrite:
            raise ConfigError(f"checkpoint.resume=none: run directory {run_dir} is not empty; "
                              "resume it (checkpoint.resume=auto), choose another name, or set "
                              "checkpoint.overwrite=true")
        return None
    path = Path(resume)
    if not is_complete(path):
        raise ConfigError(f"checkpoint.resume={resume!r}: not a checkpoint directory")
    return path


def _schedule_in_force(config: Config, scheduler) -> str:
    """The LR schedule a resumed run follows, whose it is, and this config's if it differs."""
    def describe(lr, min_lr, warmup, until) -> str:
        return f"warm-up {warmup}, cosine {lr:.2e} -> {min_lr:.2e} until step {until}"

    train_cfg = config.train
    used = describe(scheduler.max_lr, scheduler.min_lr, scheduler.lr_warmup_steps,
                    scheduler.lr_decay_steps)
    configured = describe(train_cfg.lr, train_cfg.min_lr, train_cfg.warmup_steps,
                          train_cfg.steps)
    choice = train_cfg.schedule_on_resume
    unused = ("" if used == configured else
              f"; this config's ({configured}) is not used: train.schedule_on_resume=config")
    return f"LR schedule of the {choice} (train.schedule_on_resume={choice}): {used}{unused}"


def train(config: Config) -> RunSummary:
    """Run to ``train.steps``, or stop early with a checkpoint (``RunSummary.stopped``)."""
    from t2train.monitor.metrics import quiet_other_ranks
    from t2train.signals import parse_signals
    from t2train.train.preemption import StopGuard

    quiet_other_ranks(config.log.all_ranks)
    from t2train.train.rank_failures import RankFailures
    from t2train.train.watchdog import Watchdog

    with StopGuard(parse_signals(config.train.exit_signals),
                   config.train.exit_duration_mins) as guard, \
            Watchdog(config.parallel.collective_timeout_mins) as watchdog, \
            RankFailures() as failures, ExitStack() as cleanup:
        try:
            return _run(config, guard, watchdog, cleanup)
        except RankFailure as failure:
            failures.end_all(str(failure))
            raise


def start_ranks(config: Config) -> tuple[dict, Optional[Path], int, "Topology"]:
    """A run's first steps, also ``train --dry-run``'s: the dataset's facts and the checkpoint
    to resume (checked before anything is written), then the process groups against the world
    size and the seeds. Returns (facts, resume target, data-parallel size, topology)."""
    from t2train.parallel.init import init_distributed, init_model_parallel, set_seed

    facts = dataset_facts(config)
    resume_from = _resume_target(config, Path(config.run_dir))
    init_distributed(config.parallel.collective_timeout_mins)
    dp_size = config.validate_world(dist.get_world_size())
    topology = init_model_parallel(config.parallel.tensor, config.parallel.pipeline,
                                   config.parallel.virtual_pipeline)
    set_seed(config.train.seed, topology)
    return facts, resume_from, dp_size, topology


def _run(config: Config, guard: "StopGuard", watchdog: "Watchdog",
         cleanup: ExitStack) -> RunSummary:
    from t2train.checkpoint.manager import Checkpointer
    from t2train.checkpoint.store import find_latest
    from t2train.engine import build_engine
    from t2train.model.build import padded_vocab_size
    from t2train.monitor.diagnostics import Diagnostics, diagnostic_micro_batches
    from t2train.monitor.metrics import Monitor
    from t2train.monitor.step_metrics import loss_scalars, step_meter
    from t2train.monitor.wandb_sink import wandb_settings
    from t2train.residual import variant_label
    from t2train.train.batches import GlobalBatchFeeder
    from t2train.train.data import open_streams

    run_dir = Path(config.run_dir)
    facts, resume_from, dp_size, topology = start_ranks(config)
    engine = build_engine(config, padded_vocab_size(facts["vocab_size"], config))

    train_state: dict = {}
    if resume_from is not None:
        loading_started = time.monotonic()
        train_state = engine.load(resume_from)
        start = (f"resumed from {resume_from} (loaded in "
                 f"{time.monotonic() - loading_started:.1f}s) | "
                 f"{_schedule_in_force(config, engine.scheduler)}")
    elif config.checkpoint.init_from:
        from t2train.checkpoint.inspect import resolve_checkpoint

        weights = resolve_checkpoint(Path(config.checkpoint.init_from))
        engine.load_weights(weights, facts["tokenizer_sha256"])
        start = f"fresh start from the weights of {weights}"
    else:
        start = "fresh start"
    start_step = train_state.get("step", 0)

    train_cfg = config.train
    num_micro = config.micro_batches_per_step(dp_size)
    streams = open_streams(config, topology, dp_size, train_state.get("data_state"))
    cleanup.callback(streams.close)  # also when the run fails: see TokenBatches.close
    feeder = GlobalBatchFeeder(streams.train, num_micro, train_cfg.micro_batch_size,
                               config.model.seq_length)
    val_feeder = GlobalBatchFeeder(streams.val, num_micro, train_cfg.micro_batch_size,
                                   config.model.seq_length)
    val_batches = [val_feeder.next_step() for _ in range(train_cfg.eval_batches)]

    logging_rank = topology.is_logging_rank
    if logging_rank:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(config))
    monitor = Monitor(run_dir if logging_rank else None, train_cfg.steps,
                      tensorboard=config.log.tensorboard, wandb=wandb_settings(config),
                      resumed_at=start_step if resume_from is not None else None,
                      console=logging_rank or config.log.all_ranks,
                      prefix=f"[rank {topology.rank}] " if config.log.all_ranks else "")
    engine_name = (f"deepspeed ZeRO-{config.deepspeed.zero_stage}"
                   if config.train.engine == "deepspeed" else "megatron")
    monitor.print(f"t2train: {variant_label(config.model)} residual, "
                  f"{config.model.num_layers} layers, "
                  f"{engine.num_parameters() / 1e6:.2f}M parameters on rank 0 | world "
                  f"{topology.world_size} = TP {topology.tp_size} x PP {topology.pp_size} x DP "
                  f"{dp_size} | engine {engine_name} | {start}")
    if config.log.tensorboard:
        monitor.print(f"TensorBoard: tensorboard --logdir {run_dir.parent} (this run is "
                      f"{run_dir.name!r}; its event files are in {run_dir})")
    meter, mfu_note = step_meter(config, engine.vocab_size, topology.world_size, train_state)
    monitor.print(mfu_note)
    diagnostics = Diagnostics(engine, config.log.diagnostics_interval,
                              diagnostic_micro_batches(val_batches, config), monitor,
                              sends=topology.tp_rank == 0 and topology.dp_rank == 0)

    summary = RunSummary(run_dir=run_dir, start_step=start_step, final_step=start_step)

    def report_save(step: int, blocked: float, total: float, path: Path) -> None:
        monitor.scalars(step, {"checkpoint/save_seconds": total,
                               "checkpoint/blocked_seconds": blocked})
        monitor.print(f"step {step:>6} | saved {path} ({total:.1f}s"
                      f"{f', training blocked {blocked:.1f}s' if blocked < total else ''})")

    checkpointer = Checkpointer(run_dir / "checkpoints", config, engine, report_save,
                                monitor=monitor, counters=train_state)

    def save(step: int) -> None:
        with watchdog.phase(f"the checkpoint save of step {step}"):
            summary.checkpoint = checkpointer.save(
                step, {"data_state": streams.shared_state_dict(), **meter.counters(),
                       # which tokenizer the ids mean (eval refuses a dataset of another)
                       "tokenizer_sha256": facts["tokenizer_sha256"]})

    def evaluate(step: int) -> None:
        with watchdog.phase(f"the evaluation at step {step}"):
            summary.val_losses[step] = engine.evaluate(val_batches)
        monitor.scalars(step, loss_scalars("val", summary.val_losses[step]))
        monitor.print(f"step {step:>6} | val loss {summary.val_losses[step]:.4f}")

    if resume_from is not None and config.checkpoint.save_on_resume:
        save(start_step)
    if start_step == 0:
        evaluate(0)
    skipped_in_a_row = 0
    for step in range(start_step + 1, train_cfg.steps + 1):
        started = time.monotonic()
        with watchdog.phase(f"training step {step}"):
            micro_batches = feeder.next_step()
            fed = time.monotonic()
            result = engine.train_step(micro_batches)
        meter.record(time.monotonic() - started, fed - started, result.skipped)
        summary.losses[step] = result.loss
        skipped_in_a_row = skipped_in_a_row + 1 if result.skipped else 0
        if result.skipped:
            monitor.print(f"step {step:>6} | update skipped: {result.skip_reason} "
                          f"({skipped_in_a_row} in a row; train/skipped_steps counts them)")
        if skipped_in_a_row >= train_cfg.max_skipped_steps:
            checkpointer.close()
            monitor.close()
            raise TrainingHalted(
                f"step {step}: {skipped_in_a_row} updates skipped in a row "
                f"(train.max_skipped_steps={train_cfg.max_skipped_steps}), the last for "
                f"{result.skip_reason}; stopped without saving. Last checkpoint: "
                f"{summary.checkpoint or find_latest(run_dir / 'checkpoints') or 'none'}")
        if step % train_cfg.log_interval == 0 or step == train_cfg.steps:
            scalars = meter.scalars(result, engine.param_norm())
            monitor.scalars(step, scalars)
            monitor.progress(step, result.loss, result.lr, scalars["throughput/tokens_per_sec"],
                             step - start_step)
        if diagnostics.due(step):
            diagnostics.log(step)
        if step % train_cfg.eval_interval == 0 or step == train_cfg.steps:
            evaluate(step)
        checkpointer.poll()
        saved = checkpointer.due(step, train_cfg.steps)
        if saved:
            save(step)
        summary.final_step = step
        if step < train_cfg.steps:
            summary.stopped = guard.should_stop()  # collective: every rank stops here or none
        if summary.stopped:
            monitor.print(f"step {step:>6} | stopping early: {summary.stopped}")
            if not saved:
                save(step)
            break
    checkpointer.close()
    monitor.close()
    if checkpointer.last_failed_step == summary.final_step:
        summary.final_save_failed = True
        summary.checkpoint = checkpointer.last_published()
    return summary
