"""Training engines: what the training loop drives to step, evaluate, save and load a model.

Both engines train the same Megatron-core model (t2train/model/) with the same data, schedule
and logging; they differ in how gradients, optimizer state and checkpoints are handled:

* ``megatron`` (megatron/): Megatron-core DDP or distributed optimizer and its pipeline
  schedules; every TP/SP/PP/VPP layout; reshardable dist-checkpointing checkpoints.
* ``deepspeed`` (deepspeed/): DeepSpeed ZeRO stages 1-3 with optional host offload,
  Megatron-core TP as DeepSpeed's model-parallel unit, PP = 1; DeepSpeed's sharded checkpoints.

Each engine folder also reads its own checkpoints back: as a fresh run's start weights
(``weights_reader``) and for export (``export_reader``); the types the loop and the engines
share are in ``interface.py``, helpers both engines use in ``shared.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from t2train.config.schema import Config
from t2train.engine.interface import Engine as Engine
from t2train.engine.interface import MicroBatch as MicroBatch
from t2train.engine.interface import StepResult as StepResult

if TYPE_CHECKING:
    # for annotations only: the start weights read through ``weights_reader`` below
    from t2train.engine.start_weights import StartWeights


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


def weights_reader(engine: str) -> Callable:
    """``read_weights(path, train_state, chunks) -> [state dict per chunk]`` of the engine
    that wrote a checkpoint (``t2train.checkpoint.paths.checkpoint_engine``), for a fresh
    run of either engine that starts from it (``checkpoint.init_from``)."""
    if engine == "deepspeed":
        from t2train.engine.deepspeed.export import read_weights  # noqa: PLC0415 - each engine's library loads when its checkpoint is read
    else:
        from t2train.engine.megatron.checkpoint import read_weights  # noqa: PLC0415 - each engine's library loads when its checkpoint is read
    return read_weights


def export_reader(engine: str) -> Callable:
    """``load_for_export(path, train_state, build) -> (model, stored dtype)`` of the engine
    that wrote a checkpoint (``t2train.checkpoint.paths.checkpoint_engine``)."""
    if engine == "deepspeed":
        from t2train.engine.deepspeed.export import load_for_export  # noqa: PLC0415 - each engine's library loads when it is chosen
    else:
        from t2train.engine.megatron.export import load_for_export  # noqa: PLC0415 - each engine's library loads when it is chosen
    return load_for_export
