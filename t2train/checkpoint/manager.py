"""The trainer's checkpoint policy: when to save, sync or async, what to keep, what to log,
and what a save that fails (a full or read-only disk) does: ``checkpoint.on_save_error``."""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, NoReturn, Optional

import torch
import torch.distributed as dist

from t2train.checkpoint.errors import NonFiniteState
from t2train.checkpoint.paths import INCOMPLETE, LATEST, is_complete, step_dir_name
from t2train.checkpoint.retention import apply_retention
from t2train.config.schema import CONFIG_FORMAT, Config
from t2train.errors import RankFailure, TrainingHalted
from t2train.version import code_version

# EX_IOERR (sysexits.h): the run ended (train.steps reached, or stopped early) but its last
# checkpoint could not be written (checkpoint.on_save_error=continue); a job script must not
# take the run for finished, nor requeue it as if it had saved.
SAVE_FAILED_EXIT_CODE = 74


def describe_save_error(err: BaseException) -> str:
    """One line: the OS error (with its path) under a failed save, else the error itself.

    torch's ``CheckpointException`` (a ``BaseException``) wraps each failed rank's error."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items())[0]
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {describe_save_error(inner)}"
    seen: Optional[BaseException] = err
    while seen is not None:  # the OS error names the file and the cause
        if isinstance(seen, OSError):
            break
        seen = seen.__cause__ or seen.__context__
    if isinstance(seen, OSError):
        where = f": {seen.filename!r}" if seen.filename else ""
        return f"{type(seen).__name__}: [Errno {seen.errno}] {seen.strerror or seen}{where}"
    lines = str(err).strip().splitlines()  # a long message's first line says what failed
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def _write_probe(directory: Path, size: int) -> None:
    """Write ``size`` bytes into ``directory`` and sync them to disk; raises the OSError."""
    probe = directory / f".write-test-{os.getpid()}"  # ranks may probe one directory together
    try:
        with open(probe, "wb") as stream:
            stream.write(b"\0" * size)
            stream.flush()
            os.fsync(stream.fileno())
    finally:
        probe.unlink(missing_ok=True)


def explain_save_error(err: BaseException, staging: Path) -> str:
    """``describe_save_error``, with the OS error behind a failed write named: torch's
    serializer reports a short write only as "unexpected pos N vs M" (the OSError stays in the
    writer process), so a write is tried again where the shards go, and its OS error (a full
    disk, a file size limit) and the directory are put first."""
    described = describe_save_error(err)
    if "Error: [Errno " in described or not staging.is_dir():
        return described
    try:
        _write_probe(staging, 1 << 20)
    except OSError as probed:
        return (
            f"{type(probed).__name__}: [Errno {probed.errno}] {probed.strerror}: "
            f"'{staging}' (a write there fails now; the writer reported {described})"
        )
    return described


def _full_path(function, path, exc_info) -> None:
    """shutil.rmtree's error handler: the error with the full path (rmtree reports names
    relative to the directory it is in)."""
    err = exc_info[1]
    if isinstance(err, OSError):
        raise type(err)(err.errno, err.strerror, path) from None
    raise err


# Errors of a save that may be the disk's, or a state that must not be saved (they are
# caught, agreed on and reported); others are bugs and propagate. CheckpointException is torch
# DCP's wrapper of failed ranks' writes.
def _save_errors() -> tuple:
    from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: PLC0415 - Megatron's checkpointing: when a save fails
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415 - torch DCP: when a save fails

    return (OSError, CheckpointException, CheckpointingException, NonFiniteState)


def _seen_by_every_rank(err: BaseException) -> bool:
    """torch DCP gathers every rank's planning and writing errors and raises them on all ranks
    together (``CheckpointException``), as the finiteness check does (``NonFiniteState``); any
    other error of a save is this rank's alone, and its peers may be waiting for it in one of
    the save's collectives."""
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415 - torch DCP: when a save fails

    return isinstance(err, (CheckpointException, NonFiniteState)) or dist.get_world_size() == 1


class Checkpointer:
    """Saves for the training loop; every method is a collective (all ranks call it).

    ``report(step, seconds_blocked, seconds_total, path)`` is told about each published save:
    sync saves block for their whole duration; async saves block only while
    the state is prepared and the writer forked.

    A save that fails (the directory cannot be written, the disk is full, a rank's write
    fails) leaves the previous checkpoint and ``latest`` as they were; all ranks agree on the
    failure (one all-reduce), so none waits for the others. ``checkpoint.on_save_error=stop``
    then ends the run (``TrainingHalted``, exit code 3) naming the path and the OS error;
    ``continue`` warns, counts it (``checkpoint/failed_saves``) and trains on, trying again at
    the next save; ``last_failed_step`` tells the loop whether its final save was lost.
    A rank that fails alone inside the engine's save, where the others may wait for it in a
    collective, cannot agree with them: every rank stops (``RankFailure``), under either policy.
    """

    def __init__(
        self,
        root: Path,
        config: Config,
        engine,
        report: Callable[[int, float, float, Path], None],
        monitor=None,
        counters: Optional[dict] = None,
    ):
        self.root, self.engine, self.report, self.monitor = root, engine, report, monitor
        self.settings = config.checkpoint
        self.manifest = {
            "config": asdict(config),
            "config_format": CONFIG_FORMAT,
            "code_version": code_version(),
        }
        self.queue = None
        if self.settings.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: PLC0415 - checkpoint.async_save only

            self.queue = AsyncCallsQueue()
        self._pending: dict[Path, tuple[int, float, float]] = {}  # path -> step, start, blocked
        self.failed_saves = (counters or {}).get("failed_saves", 0)  # in the run, over resumes
        self.last_failed_step: Optional[int] = None

    def due(self, step: int, last_step: int) -> bool:
        return step % self.settings.interval == 0 or step == last_step

    def save(self, step: int, train_state: dict) -> Optional[Path]:
        """Save ``step`` (waits for an async save still running: one in flight at a time).

        Returns the checkpoint being written, or after a failed save (``continue``) the last
        published one (None if there is none)."""
        self.wait()
        started = time.monotonic()
        error = self._agree(self._prepare_directory(step))
        if error is None:
            try:
                path = self.engine.save(
                    self.root,
                    step,
                    dict(train_state, failed_saves=self.failed_saves, **self.manifest),
                    self.queue,
                    self._published,
                )
            except _save_errors() as err:
                error = explain_save_error(err, self.root / (step_dir_name(step) + INCOMPLETE))
                if not _seen_by_every_rank(err):
                    self._failed_alone(step, error)
            error = self._agree(error)
        if error is not None:
            self._failed(step, error)
            return self.last_published()
        blocked = time.monotonic() - started
        if self.queue is None:
            self.report(step, blocked, blocked, path)
        else:
            self._pending[path] = (step, started, blocked)
        return path

    def poll(self) -> None:
        """Publish a finished async save, without waiting for one still being written."""
        self._finalize(blocking=False)

    def wait(self) -> None:
        """Publish every async save, waiting for the writers."""
        self._finalize(blocking=True)

    def close(self, abandon: bool = False) -> None:
        """Publish every async save and release the writer's queue; ``abandon`` (the run is
        failing) skips the publication, a collective that failed peers would never join."""
        if not abandon:
            self.wait()
        if self.queue is not None:
            self.queue.close()
        if self.failed_saves:
            last = self.last_published()
            self._say(
                f"warning: {self.failed_saves} checkpoint save(s) failed in this run; the "
                f"newest published checkpoint is {last or 'none'}"
            )

    def last_published(self) -> Optional[Path]:
        """The checkpoint ``latest`` names, if it is complete."""
        marker = self.root / LATEST
        try:
            named = self.root / marker.read_text().strip()
        except (OSError, ValueError):
            return None
        return named if is_complete(named) else None

    # --- failures ------------------------------------------------------------------------
    def _prepare_directory(self, step: int) -> Optional[str]:
        """Rank 0 creates the staging directory and writes a probe file into it (what the
        engine's save does first, without a collective in between): a read-only directory, a
        name in the way or a full disk fail here on rank 0 alone, before any rank writes."""
        if dist.get_rank() != 0:
            return None
        staging = self.root / (step_dir_name(step) + INCOMPLETE)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging, onerror=_full_path)
            staging.mkdir()
            _write_probe(staging, 65536)
        except OSError as err:
            return describe_save_error(err)
        return None

    def _agree(self, error: Optional[str]) -> Optional[str]:
        """Collective: every rank learns whether any rank failed, and the first one's error."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return error
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return None
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        return next(
            (f"{e}" if e.startswith("rank ") else f"rank {rank}: {e}")
            for rank, e in enumerate(errors)
            if e is not None
        )

    def _cause(self, step: int, error: str, staging: Path) -> str:
        last = self.last_published()
        kept = (
            f"the last good checkpoint {last} is intact and `latest` still names it"
            if last is not None
            else "no earlier checkpoint exists"
        )
        try:
            free = f" ({shutil.disk_usage(self.root).free / 2**30:.1f} GiB free there)"
        except OSError:
            free = ""
        return f"checkpoint save of step {step} to {staging}{free} failed: {error}; {kept}"

    def _failed_alone(self, step: int, error: str, staging: Optional[Path] = None) -> NoReturn:
        """This rank failed inside the engine's save: stop every rank (no collective now, the
        peers may be blocked in one of the save's)."""
        staging = staging or self.root / (step_dir_name(step) + INCOMPLETE)
        rank = dist.get_rank()
        if self.monitor is not None:
            self.monitor.close()
        raise RankFailure(
            f"{self._cause(step, f'rank {rank}: {error}', staging)}. Every rank "
            f"stops: rank {rank} failed alone inside the save, where the others "
            "wait for it (checkpoint.on_save_error does not apply); free or fix "
            "the checkpoint directory and run again to resume"
        )

    def _failed(self, step: int, error: str, staging: Optional[Path] = None) -> None:
        """Every rank: clean up, then stop or warn and count, as configured."""
        staging = staging or self.root / (step_dir_name(step) + INCOMPLETE)
        if dist.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # best effort: the disk may refuse
        self.failed_saves += 1
        self.last_failed_step = step
        cause = self._cause(step, error, staging)
        if self.settings.on_save_error == "stop":
            if self.queue is not None:
                self.queue.close()
            if self.monitor is not None:
                self.monitor.close()
            raise TrainingHalted(
                f"{cause}. Stopped (checkpoint.on_save_error=stop): free or fix "
                "the checkpoint directory and run again to resume, or set "
                "checkpoint.on_save_error=continue to train on"
            )
        self._say(
            f"step {step:>6} | warning: {cause}; training continues "
            f"(checkpoint.on_save_error=continue, {self.failed_saves} failed so far)"
        )
        if self.monitor is not None:
            self.monitor.scalars(step, {"checkpoint/failed_saves": self.failed_saves})

    def _say(self, message: str) -> None:
        if self.monitor is not None:
            self.monitor.print(message)
        elif dist.get_rank() == 0:
            print(message, file=sys.stderr, flush=True)

    def _finalize(self, blocking: bool) -> None:
        """Publish finished async saves; a failed one is handled like a failed sync save (the
        queue raises it on every rank)."""
        if self.queue is None:
            return
        try:
            self.queue.maybe_finalize_async_calls(blocking=blocking)
        except _save_errors() as err:
            # the failed request is the oldest pending one (one in flight at a time)
            path, (step, _, _) = next(iter(self._pending.items()))
            self._pending.pop(path)
            staging = path.with_name(path.name + INCOMPLETE)
            error = explain_save_error(err, staging)
            if not _seen_by_every_rank(err):
                self._failed_alone(step, error, staging)
            self._failed(step, error, staging)

    def _published(self, path: Path) -> None:
        if dist.get_rank() == 0:
            apply_retention(self.root, self.settings.keep_last, self.settings.keep_every)
        if path in self._pending:
            step, started, blocked = self._pending.pop(path)
            self.report(step, blocked, time.monotonic() - started, path)
