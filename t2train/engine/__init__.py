"""Training engines: what the training loop drives to step, evaluate, save and load a model.

Both engines train the same Megatron-core model (t2train/model/) with the same data, schedule
and logging; they differ in how gradients, optimizer state and checkpoints are handled:

* ``megatron`` (megatron/): Megatron-core DDP or distributed optimizer and its pipeline
  schedules; every TP/SP/PP/VPP layout; reshardable dist-checkpointing checkpoints.
* ``deepspeed`` (deepspeed/): DeepSpeed ZeRO stages 1-3 with optional host offload,
  Megatron-core TP as DeepSpeed's model-parallel unit, PP = 1; DeepSpeed's sharded checkpoints.

Each engine folder also reads its own checkpoints back for export (``export.py``,
``export_reader``); helpers both engines use are in ``shared.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Protocol

from t2train.config.schema import Config
from t2train.engine.start_weights import StartWeights
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


def build_engine(
    config: Config, vocab_size: int, start_weights: Optional[StartWeights] = None
) -> Engine:
    """Collective: every rank builds its part of the model and optimizer, the model filled
    with ``start_weights`` when given (a fresh run's ``checkpoint.init_from``)."""
    if config.train.engine == "deepspeed":
        from t2train.engine.deepspeed.engine import DeepSpeedEngine  # noqa: PLC0415 - each engine's library loads when it is chosen

        return DeepSpeedEngine(config, vocab_size, start_weights)
    from t2train.engine.megatron import MegatronEngine  # noqa: PLC0415 - each engine's library loads when it is chosen

    return MegatronEngine(config, vocab_size, start_weights)


def export_reader(engine: str) -> Callable:
    """``load_for_export(path, train_state, build) -> (model, stored dtype)`` of the engine
    that wrote a checkpoint (``t2train.checkpoint.paths.checkpoint_engine``)."""
    if engine == "deepspeed":
        from t2train.engine.deepspeed.export import load_for_export  # noqa: PLC0415 - each engine's library loads when it is chosen
    else:
        from t2train.engine.megatron.export import load_for_export  # noqa: PLC0415 - each engine's library loads when it is chosen
    return load_for_export
