"""What the training loop and every engine share: a micro-batch, a step's result and the
``Engine`` protocol. Its own module, so that the engines import it without importing the
package that chooses among them."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Protocol

from t2train.config.schema import Config
from t2train.monitor.stragglers import ForwardClock

if TYPE_CHECKING:
    # for annotations only: torch and Megatron, which each engine imports when chosen
    from t2train.engine.shared import LRSchedule

MicroBatch = dict  # {"tokens": LongTensor[b, s], "labels": LongTensor[b, s]}


@dataclass
class StepResult:
    """One optimizer step. ``grad_norm`` and ``traffic`` are read when first asked for (the
    trainer asks on logging steps, on every rank alike): on a GPU reading the norm waits for
    the device, and the traffic is summed over ranks by a collective, so a step that logs
    nothing pays for neither."""

    loss: float
    lr: float
    skipped: bool
    read_grad_norm: Callable[[], float]
    read_traffic: Callable[[], dict]  # pipeline bytes and hops of this step, over all ranks
    skip_reason: str = ""  # why the update was skipped (t2train/engine/megatron/numerics.py)

    @functools.cached_property
    def grad_norm(self) -> float:
        return self.read_grad_norm()

    @functools.cached_property
    def traffic(self) -> dict:
        return self.read_traffic()


class Engine(Protocol):
    config: Config
    vocab_size: int
    model: list  # this rank's chunks; each has ``.module``, the T2GPTModel
    scheduler: LRSchedule  # Megatron's OptimizerParamScheduler: the LR schedule in force
    forward_clock: ForwardClock  # the time of this rank's training forward passes

    def train_step(self, micro_batches: list[MicroBatch]) -> StepResult: ...

    def evaluate(self, batches: list[list[MicroBatch]]) -> float: ...

    def save(
        self,
        root: Path,
        step: int,
        train_state: dict,
        async_queue=None,
        on_published: Optional[Callable[[Path], None]] = None,
    ) -> Path: ...

    def load(self, path: Path) -> dict: ...

    def param_norm(self) -> float: ...

    def num_parameters(self) -> int: ...

    def describe(self) -> str: ...  # the engine as the run's first line names it
