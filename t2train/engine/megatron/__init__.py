"""The Megatron-core engine: DDP chunks, Megatron's optimizer and pipeline schedules."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from t2train.config.schema import Config
from t2train.engine.interface import MicroBatch, StepResult
from t2train.engine.megatron.checkpoint import load_checkpoint, save_checkpoint
from t2train.engine.megatron.numerics import UpdateGuard
from t2train.engine.megatron.setup import build_training_objects
from t2train.engine.megatron.step import evaluate, train_step
from t2train.engine.start_weights import StartWeights
from t2train.monitor.step_metrics import param_norm
from t2train.monitor.stragglers import ForwardClock


class MegatronEngine:
    def __init__(
        self, config: Config, vocab_size: int, start_weights: Optional[StartWeights] = None
    ):
        self.objs = build_training_objects(config, vocab_size, start_weights)
        self.config, self.vocab_size, self.model = config, vocab_size, self.objs.model
        self.scheduler = self.objs.scheduler
        self.guard = UpdateGuard(config.train)
        self.forward_clock = ForwardClock()

    def train_step(self, micro_batches: list[MicroBatch]) -> StepResult:
        return train_step(self.objs, micro_batches, self.guard, self.forward_clock)

    def evaluate(self, batches: list[list[MicroBatch]]) -> float:
        return evaluate(self.objs, batches)

    def save(
        self,
        root: Path,
        step: int,
        train_state: dict,
        async_queue=None,
        on_published: Optional[Callable[[Path], None]] = None,
    ) -> Path:
        return save_checkpoint(root, step, self.objs, train_state, async_queue, on_published)

    def load(self, path: Path) -> dict:
        return load_checkpoint(path, self.objs, self.config)

    def param_norm(self) -> float:
        return param_norm(self.model)

    def num_parameters(self) -> int:
        return sum(p.numel() for chunk in self.model for p in chunk.parameters())

    def describe(self) -> str:
        return "megatron"
