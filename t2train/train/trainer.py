"""The ``Trainer``: one training run, in torchtitan's manner.

Construction builds everything the run needs, in order: the inputs checked before anything
is written (``inputs.py``), the process groups and seeds, the engine with its model and
optimizer (loaded from the checkpoint it resumes, or from ``checkpoint.init_from``), the data
streams, the monitor and the checkpointer. ``run`` then loops ``step``, which trains, logs,
evaluates and saves as their intervals fall, and ``stop``, the collective decision to stop
early, until ``train.steps``. Every resource the run opens is closed by one ``ExitStack``
(``close``, or leaving the ``with`` block), also when the run fails.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from t2train.checkpoint.errors import CheckpointError
from t2train.checkpoint.integrity import (
    choose_verified,
    resume_candidates,
    say,
    verify_checksums,
)
from t2train.checkpoint.manager import Checkpointer
from t2train.checkpoint.store import find_latest, remove_unfinished
from t2train.config.loader import dump_config
from t2train.config.lr_schedule import configured_lr_schedule, describe_lr_schedule
from t2train.config.schema import Config
from t2train.engine import build_engine
from t2train.engine.start_weights import StartWeights
from t2train.errors import TrainingHalted
from t2train.monitor.diagnostics import Diagnostics, diagnostic_micro_batches
from t2train.monitor.metrics import Monitor
from t2train.monitor.profiler import StepProfiler
from t2train.monitor.step_metrics import loss_scalars, step_meter
from t2train.monitor.stragglers import StragglerMeter, straggler_scalars, straggler_warning
from t2train.monitor.wandb_sink import wandb_settings
from t2train.parallel.init import Topology, init_distributed, init_model_parallel, set_seed
from t2train.residual import variant_label
from t2train.run_lock import RunDirectoryInUse, RunLock, describe_holder
from t2train.train.batches import GlobalBatchFeeder
from t2train.train.data import open_streams
from t2train.train.inputs import dataset_facts, resume_target
from t2train.train.preemption import StopGuard
from t2train.train.summary import RunSummary
from t2train.train.watchdog import Watchdog


def start_ranks(config: Config) -> tuple[dict, Optional[Path], int, Topology]:
    """A run's first steps, also ``train --dry-run``'s: the dataset's facts and the checkpoint
    to resume (checked before anything is written), then the process groups against the world
    size and the seeds. Returns (facts, resume target, data-parallel size, topology)."""
    facts = dataset_facts(config)
    resume_from = resume_target(config, Path(config.run_dir))
    init_distributed(config.parallel.collective_timeout_mins)
    dp_size = config.validate_world(dist.get_world_size())
    topology = init_model_parallel(
        config.parallel.tensor, config.parallel.pipeline, config.parallel.virtual_pipeline
    )
    set_seed(config.train.seed, topology)
    return facts, resume_from, dp_size, topology


def weights_to_start_from(config: Config, facts: dict) -> Optional[StartWeights]:
    """The checkpoint or weights file a fresh run starts from (``checkpoint.init_from``), its
    files verified against their checksums; None without one."""
    if not config.checkpoint.init_from:
        return None
    return StartWeights.named(
        config.checkpoint.init_from, facts["tokenizer_sha256"], facts["vocab_size"]
    )


def verified(config: Config, run_dir: Path, resume_from: Path) -> tuple[Path, str]:
    """Collective: the checkpoint to load once its checksums verify, and a note naming the
    damaged ones skipped. ``checkpoint.resume=auto`` falls back to the newest checkpoint that
    verifies unless ``checkpoint.on_damaged=stop``; a checkpoint named explicitly is used or
    refused."""
    if config.checkpoint.resume != "auto":
        damage = verify_checksums(resume_from)
        if damage is not None:
            others = [path for path in resume_candidates(resume_from.parent) if path != resume_from]
            usable = next((path for path in others if verify_checksums(path) is None), None)
            raise CheckpointError(
                f"checkpoint.resume={config.checkpoint.resume}: {resume_from} is damaged: "
                f"{damage}; "
                + (
                    f"the newest checkpoint beside it that verifies is {usable}: "
                    f"resume it with checkpoint.resume={usable}"
                    if usable
                    else "no checkpoint beside it verifies: restore a copy"
                )
            )
        return resume_from, ""
    chosen, skipped = choose_verified(
        resume_candidates(run_dir / "checkpoints"),
        fall_back=config.checkpoint.on_damaged == "fall_back",
    )
    for path, damage in skipped:
        say(
            f"skipping damaged checkpoint {path}: {damage}; resuming from {chosen}, the newest "
            "that verifies (checkpoint.on_damaged=fall_back; set it to stop to refuse instead)"
        )
    return chosen, "".join(f" | skipped damaged {path.name}" for path, _ in skipped)


def schedule_in_force(config: Config, scheduler) -> str:
    """The LR schedule a resumed run follows, whose it is, and this config's if it differs."""
    used = describe_lr_schedule(
        scheduler.lr_decay_style,
        scheduler.max_lr,
        scheduler.min_lr,
        scheduler.lr_warmup_steps,
        scheduler.lr_decay_steps,
        scheduler.wsd_decay_steps,
        scheduler.lr_wsd_decay_style,
    )
    configured = configured_lr_schedule(config.train)
    choice = config.train.schedule_on_resume
    unused = (
        ""
        if used == configured
        else f"; this config's ({configured}) is not used: train.schedule_on_resume=config"
    )
    return f"LR schedule of the {choice} (train.schedule_on_resume={choice}): {used}{unused}"


class Trainer:
    """One run: ``Trainer(config, guard, watchdog)``, then ``run()`` (or ``step``, ``evaluate``,
    ``save`` and ``stop`` one at a time); use it as a context manager, or call ``close``."""

    def __init__(self, config: Config, guard: StopGuard, watchdog: Watchdog):
        self.config, self.guard, self.watchdog = config, guard, watchdog
        self.resources = ExitStack()
        try:
            self._build()
        except BaseException:
            self.resources.close()
            raise

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.resources.__exit__(*exc)

    def close(self) -> None:
        """Close what the run opened, in reverse order: the checkpointer (publishing every
        async save), the monitor, the data streams."""
        self.resources.close()

    # --- construction ------------------------------------------------------------------------
    def _build(self) -> None:
        config = self.config
        self.run_dir = Path(config.run_dir)
        self.facts, resume_from, self.dp_size, self.topology = start_ranks(config)
        self._lock_run_directory()
        skipped, start_weights = "", None
        if resume_from is not None:
            resume_from, skipped = verified(config, self.run_dir, resume_from)
        else:
            start_weights = weights_to_start_from(config, self.facts)
        self.engine = build_engine(
            config, config.padded_vocab_size(self.facts["vocab_size"]), start_weights
        )
        train_state, start = self._load(resume_from, skipped, start_weights)
        self.start_step = train_state.get("step", 0)
        self.resumed = resume_from is not None
        self.loaded = self.resumed or start_weights is not None  # a checkpoint or its weights
        self._open_data(train_state)
        self._open_monitor(start)
        self.meter, mfu_note = step_meter(
            config, self.engine.vocab_size, self.topology.world_size, train_state
        )
        self.monitor.print(mfu_note)
        self.stragglers = StragglerMeter(self.topology.pp_rank)
        self.diagnostics = Diagnostics(
            self.engine,
            config.log.diagnostics_interval,
            diagnostic_micro_batches(self.val_batches, config),
            self.monitor,
            sends=self.topology.tp_rank == 0 and self.topology.dp_rank == 0,
        )
        self.summary = RunSummary(
            run_dir=self.run_dir, start_step=self.start_step, final_step=self.start_step
        )
        self.profiler = StepProfiler(config.log, self.run_dir, self.topology.rank)
        self.resources.callback(self.profiler.close)
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints",
            config,
            self.engine,
            self._report_save,
            monitor=self.monitor,
            counters=train_state,
        )
        # An exception leaves async saves unpublished: waiting for them is a collective,
        # which peers that failed would never join.
        self.resources.push(lambda kind, *_: self.checkpointer.close(abandon=kind is not None))
        self.skipped_in_a_row = 0

    def _lock_run_directory(self) -> None:
        """Collective: rank 0 takes the run directory's lock (held until the run closes), or
        every rank stops with the holder named, before anything is written (run_lock.py).
        Only once every rank has looked at the directory (``resume_target``): a second run in
        the same process group starts without a rendezvous that would wait for that."""
        dist.barrier()
        refusal = None
        if self.topology.rank == 0:
            try:
                lock = RunLock(self.run_dir)
            except RunDirectoryInUse as err:
                refusal = str(err)
            else:
                self.resources.callback(lock.release)
                self._clean_up_after(lock)
        box = [refusal]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise RunDirectoryInUse(box[0])

    def _clean_up_after(self, lock: RunLock) -> None:
        """Holding the lock: remove the saves a killed run left unfinished, and name in one
        line what was taken over and removed (nothing is left to clean by hand)."""
        left = [
            f"removed its unfinished save {path}"
            if error is None
            else f"could not remove its unfinished save {path} ({error})"
            for path, error in remove_unfinished(self.run_dir / "checkpoints").items()
        ]
        if lock.taken_over is not None:
            left.insert(0, f"took over its lock {lock.path} ({describe_holder(lock.taken_over)})")
        if left:
            print(
                f"t2train: an earlier run of {self.run_dir} ended without cleaning up: "
                + "; ".join(left),
                flush=True,
            )

    def _load(
        self, resume_from: Optional[Path], skipped: str, start_weights: Optional[StartWeights]
    ) -> tuple[dict, str]:
        """The train state to continue (empty for a fresh start) and how the run starts (the
        engine loaded ``start_weights`` as it was built)."""
        if resume_from is not None:
            loading_started = time.monotonic()
            train_state = self.engine.load(resume_from)
            return train_state, (
                f"resumed from {resume_from} (loaded in "
                f"{time.monotonic() - loading_started:.1f}s){skipped} | "
                f"{schedule_in_force(self.config, self.engine.scheduler)}"
            )
        if start_weights is not None:
            return {}, f"fresh start from the weights of {start_weights.path}"
        return {}, "fresh start"

    def _open_data(self, train_state: dict) -> None:
        config, train_cfg = self.config, self.config.train
        self.streams = open_streams(
            config, self.topology, self.dp_size, train_state.get("data_state")
        )
        self.resources.callback(self.streams.close)  # see TokenBatches.close
        num_micro = config.micro_batches_per_step(self.dp_size)
        self.feeder = GlobalBatchFeeder(
            self.streams.train, num_micro, train_cfg.micro_batch_size, config.model.seq_length
        )

        def fixed_batches(stream) -> list:
            feeder = GlobalBatchFeeder(
                stream, num_micro, train_cfg.micro_batch_size, config.model.seq_length
            )
            return [feeder.next_step() for _ in range(train_cfg.eval_batches)]

        self.val_batches = fixed_batches(self.streams.val)
        self.labelled_val_batches = {
            label: fixed_batches(stream) for label, stream in self.streams.labelled.items()
        }

    def _open_monitor(self, start: str) -> None:
        config, topology, run_dir = self.config, self.topology, self.run_dir
        logging_rank = topology.is_logging_rank
        if logging_rank:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(dump_config(config))
        self.monitor = Monitor(
            run_dir if logging_rank else None,
            config.train.steps,
            tensorboard=config.log.tensorboard,
            wandb=wandb_settings(config),
            resumed_at=self.start_step if self.resumed else None,
            console=logging_rank or config.log.all_ranks,
            prefix=f"[rank {topology.rank}] " if config.log.all_ranks else "",
        )
        self.resources.callback(self.monitor.close)
        self.monitor.print(
            f"t2train: {variant_label(config.model)} residual, {config.model.num_layers} "
            f"layers, {self.engine.num_parameters() / 1e6:.2f}M parameters on rank 0 | world "
            f"{topology.world_size} = TP {topology.tp_size} x PP {topology.pp_size} x DP "
            f"{self.dp_size} | engine {self.engine.describe()} | {start}"
        )
        if config.log.tensorboard:
            self.monitor.print(
                f"TensorBoard: tensorboard --logdir {run_dir.parent} (this run "
                f"is {run_dir.name!r}; its event files are in {run_dir})"
            )

    # --- the run -------------------------------------------------------------------------
    def run(self) -> RunSummary:
        """Train to ``train.steps`` or an agreed stop; returns the run's summary."""
        if self.loaded and self.config.checkpoint.save_on_resume:
            self.save(self.start_step)
        if self.start_step == 0:
            self.evaluate(0)
        for step in range(self.start_step + 1, self.config.train.steps + 1):
            saved = self.step(step)
            if self.stop(step, saved):
                break
        self.close()
        if self.checkpointer.last_failed_step == self.summary.final_step:
            self.summary.final_save_failed = True
            self.summary.checkpoint = self.checkpointer.last_published()
        return self.summary

    def step(self, step: int) -> bool:
        """Train step ``step``, then log, evaluate and save where their intervals fall;
        whether a checkpoint was saved."""
        train_cfg = self.config.train
        started = time.monotonic()
        with self.watchdog.phase(f"training step {step}"):
            micro_batches = self.feeder.next_step()
            fed = time.monotonic()
            self.profiler.begin(step)
            result = self.engine.train_step(micro_batches)
            self.profiler.end(step)
        self.meter.record(time.monotonic() - started, fed - started, result.skipped)
        for written in self.profiler.written:
            self.monitor.print(f"step {step:>6} | profile written: {written}")
        self.profiler.written.clear()
        self.summary.losses[step] = result.loss
        self._count_skipped(step, result)
        if step % train_cfg.log_interval == 0 or step == train_cfg.steps:
            self._log(step, result)
        if self.diagnostics.due(step):
            self.diagnostics.log(step)
        if step % train_cfg.eval_interval == 0 or step == train_cfg.steps:
            self.evaluate(step)
        self.checkpointer.poll()
        saved = self.checkpointer.due(step, train_cfg.steps)
        if saved:
            self.save(step)
        self.summary.final_step = step
        return saved

    def _log(self, step: int, result) -> None:
        """The interval's scalars, its progress line and, when one rank is slower than its
        peers, a line naming it (collective: every rank logs at the same steps)."""
        times = self.stragglers.gather(
            self.engine.forward_clock.take(), self.meter.data_wait, self.meter.steps
        )
        scalars = self.meter.scalars(result, self.engine.param_norm())
        if times:
            scalars.update(straggler_scalars(times))
        self.monitor.scalars(step, scalars)
        self.monitor.progress(
            step,
            result.loss,
            result.lr,
            scalars["throughput/tokens_per_sec"],
            step - self.start_step,
        )
        warning = straggler_warning(times, self.config.log.straggler_factor)
        if warning:
            self.monitor.print(f"step {step:>6} | {warning}")

    def _count_skipped(self, step: int, result) -> None:
        """Updates skipped in a row (non-finite or spiking loss); too many halt the run."""
        limit = self.config.train.max_skipped_steps
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if result.skipped else 0
        if result.skipped:
            self.monitor.print(
                f"step {step:>6} | update skipped: {result.skip_reason} "
                f"({self.skipped_in_a_row} in a row; train/skipped_steps counts "
                "them)"
            )
        if self.skipped_in_a_row >= limit:
            self.close()  # every rank skipped the same updates: publishing is safe
            last = self.summary.checkpoint or find_latest(self.run_dir / "checkpoints")
            raise TrainingHalted(
                f"step {step}: {self.skipped_in_a_row} updates skipped in a row "
                f"(train.max_skipped_steps={limit}), the last for {result.skip_reason}; stopped "
                f"without saving. Last checkpoint: {last or 'none'}"
            )

    def evaluate(self, step: int) -> None:
        """The validation loss on the run's fixed held-out batches, and on each labelled
        validation set's (``data.eval_sets``: ``val/<label>/loss``)."""
        with self.watchdog.phase(f"the evaluation at step {step}"):
            loss = self.summary.val_losses[step] = self.engine.evaluate(self.val_batches)
            labelled = {
                label: self.engine.evaluate(batches)
                for label, batches in self.labelled_val_batches.items()
            }
        scalars = loss_scalars("val", loss)
        for label, value in labelled.items():
            scalars.update(loss_scalars(f"val/{label}", value))
        self.monitor.scalars(step, scalars)
        self.monitor.print(
            f"step {step:>6} | val loss {loss:.4f}"
            + "".join(f" | {label} {value:.4f}" for label, value in labelled.items())
        )

    def save(self, step: int) -> None:
        """A checkpoint of step ``step``: model, optimizer, data position, counters."""
        with self.watchdog.phase(f"the checkpoint save of step {step}"):
            self.summary.checkpoint = self.checkpointer.save(
                step,
                {
                    "data_state": self.streams.shared_state_dict(),
                    **self.meter.counters(),
                    # which tokenizer the ids mean (eval refuses a dataset of another),
                    # and the token documents start with (generate starts prompts so)
                    "tokenizer_sha256": self.facts["tokenizer_sha256"],
                    "bos_id": self.facts["bos_id"],
                },
            )

    def stop(self, step: int, saved: bool) -> bool:
        """Collective: whether every rank stops after ``step`` (a signal, the time limit),
        saving it first if its checkpoint is not written yet."""
        if step < self.config.train.steps:
            self.summary.stopped = self.guard.should_stop()
        if not self.summary.stopped:
            return False
        self.monitor.print(f"step {step:>6} | stopping early: {self.summary.stopped}")
        if not saved:
            self.save(step)
        return True

    def _report_save(self, step: int, blocked: float, total: float, path: Path) -> None:
        self.monitor.scalars(
            step, {"checkpoint/save_seconds": total, "checkpoint/blocked_seconds": blocked}
        )
        self.monitor.print(
            f"step {step:>6} | saved {path} ({total:.1f}s"
            f"{f', training blocked {blocked:.1f}s' if blocked < total else ''})"
        )
