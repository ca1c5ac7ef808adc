"""What one Megatron-engine training rank holds, as ``setup.build_training_objects`` makes it
and the step, the checkpoint and the engine read it."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.optimizer import MegatronOptimizer

from t2train.config.schema import Config
from t2train.engine.shared import LRSchedule
from t2train.model.build import T2TransformerConfig
from t2train.parallel.hop_plan import HopPlan


@dataclass
class TrainingObjects:
    config: Config
    tf_config: T2TransformerConfig
    model: list  # DDP-wrapped chunks, one per virtual pipeline stage
    optimizer: MegatronOptimizer
    scheduler: LRSchedule
    vocab_size: int
    hops: HopPlan  # what crosses each pipeline hop: the chunks send by it, the step sizes by it
