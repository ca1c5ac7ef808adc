"""RMSNorm usable under Megatron sequence parallelism.

Megatron's torch-only ``WrappedTorchNorm`` refuses sequence parallelism because its weight
lacks the ``sequence_parallel`` mark that makes ``finalize_model_grads`` all-reduce the
norm's gradient across tensor-parallel ranks (each rank saw only its sequence shard).
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        # Megatron's gradient reduction reads this marker from the parameter
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)
