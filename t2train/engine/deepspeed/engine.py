"""The DeepSpeed engine: ZeRO over the data-parallel ranks of the Megatron-core model.

The model is the one the Megatron engine trains (Megatron-core TP layers, any residual
design); DeepSpeed owns gradient averaging, ZeRO sharding, clipping, the optimizer (built
from its JSON config, t2train/engine/deepspeed/config.py) and checkpoint shards. t2train
keeps what must match the Megatron engine: Megatron's parameter groups (no weight decay on
biases and norms) and LR schedule, the loss, the data order, RNG and logging.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.optimizer import _get_param_groups
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from t2train.checkpoint.compatibility import check_same_model
from t2train.checkpoint.errors import CheckpointError
from t2train.checkpoint.integrity import check_finite, optimizer_tensors, recorded_checksums
from t2train.checkpoint.paths import ENGINE_FILE, INCOMPLETE, step_dir_name
from t2train.checkpoint.store import (
    capture_rng,
    check_engine,
    current_layout,
    publish_checkpoint,
    restore_rng,
)
from t2train.compat.library_noise import known_prints_dropped
from t2train.config.schema import Config
from t2train.engine.deepspeed.config import deepspeed_config
from t2train.engine.interface import MicroBatch, StepResult
from t2train.engine.shared import data_parallel_sum, lr_scheduler, model_loss, optimizer_config
from t2train.engine.start_weights import StartWeights
from t2train.model.build import build_model_chunks, transformer_config
from t2train.monitor.step_metrics import param_norm
from t2train.monitor.stragglers import ForwardClock
from t2train.parallel.traffic import collect_traffic


class MegatronGroups:
    """Megatron-core's process groups under the ``mpu`` names DeepSpeed asks for.

    With PP = 1 the model-parallel group is the tensor-parallel group: DeepSpeed counts
    tensor-parallel duplicates (norms) once in the gradient norm, and names checkpoint files
    by tensor-parallel rank.
    """

    get_model_parallel_group = staticmethod(ps.get_tensor_model_parallel_group)
    get_model_parallel_rank = staticmethod(ps.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(ps.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(ps.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(ps.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(ps.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_src_rank = staticmethod(ps.get_tensor_model_parallel_src_rank)
    get_data_parallel_group = staticmethod(ps.get_data_parallel_group)
    get_data_parallel_rank = staticmethod(ps.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(ps.get_data_parallel_world_size)
    get_pipeline_model_parallel_group = staticmethod(ps.get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(ps.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(ps.get_pipeline_model_parallel_world_size)


def _own_elements(param) -> torch.Tensor:
    """The elements of ``param`` this rank holds: all of them, or under ZeRO-3 its partition
    less the padding after the parameter's last element (DeepSpeed allocates partitions with
    ``torch.empty`` and copies only real elements, so the padding is arbitrary memory)."""
    part = getattr(param, "ds_tensor", None)
    if part is None:
        return param
    start = part.ds_numel * dist.get_rank(group=param.ds_process_group)
    return part.narrow(0, 0, max(0, min(part.ds_numel, param.ds_numel - start)))


def _parameter_groups(chunk, config: Config) -> list[dict]:
    """Megatron's optimizer parameter groups (``wd_mult`` 0 for biases and 1-D parameters)."""

    groups = _get_param_groups([chunk], optimizer_config(config), None)
    return [group for group in groups if group["params"]]


class DeepSpeedEngine:
    def __init__(
        self, config: Config, vocab_size: int, start_weights: Optional[StartWeights] = None
    ):
        import deepspeed  # noqa: PLC0415 - deepspeed: when the engine is built (its import probes CUDA)

        # DeepSpeed compiles some ops on first use: into the project, not the home cache.
        os.environ.setdefault(
            "TORCH_EXTENSIONS_DIR", str(Path.cwd() / ".cache" / "torch_extensions")
        )
        self.config, self.vocab_size = config, vocab_size
        self.zero_stage = config.deepspeed.zero_stage
        (chunk,) = build_model_chunks(config, transformer_config(config), vocab_size)
        if start_weights is not None:  # before ZeRO partitions the model and copies it to fp32
            start_weights.load_into([chunk], config)
        self.ds_config = deepspeed_config(config, ps.get_data_parallel_world_size())
        with known_prints_dropped():
            self.ds, optimizer, _, _ = deepspeed.initialize(
                model=chunk,
                model_parameters=_parameter_groups(chunk, config),
                config=self.ds_config,
                mpu=MegatronGroups(),
                dist_init_required=False,
            )
        self.scheduler = lr_scheduler(optimizer, config)
        self.model = [self.ds]  # like a DDP chunk: ``.module`` is the T2GPTModel
        self.forward_clock = ForwardClock()

    # --- training --------------------------------------------------------------------
    def train_step(self, micro_batches: list[MicroBatch]) -> StepResult:
        """Gradient accumulation over the micro-batches; DeepSpeed steps at the last one."""
        self.ds.train()
        self.ds.module.start_schedule()
        self.ds.module.traffic.reset()
        losses = []
        for batch in micro_batches:
            with self.forward_clock.timing():
                loss = model_loss(self.ds, batch).float().mean()
            self.ds.backward(loss)  # scaled by 1 / gradient_accumulation_steps
            self.ds.step()
            losses.append(loss.detach())
        # ZeRO skips an update whose gradient norm is not finite (fp32; bf16 with
        # check_grad_overflow, which the generated config sets).
        updated = self.ds.was_step_applied()
        if updated:
            self.scheduler.step(increment=1)
        loss_sum, count = data_parallel_sum(losses).tolist()
        loss = loss_sum / count
        reason = (
            ""
            if updated
            else (
                f"non-finite loss ({loss})" if not math.isfinite(loss) else "non-finite gradients"
            )
        )
        grad_norm = self.ds.get_global_grad_norm()
        return StepResult(
            loss=loss,
            read_grad_norm=lambda: float(grad_norm or 0.0),
            lr=self.ds.optimizer.param_groups[0]["lr"],
            skipped=not updated,
            read_traffic=collect_traffic(self.model),
            skip_reason=reason,
        )

    @torch.no_grad()
    def evaluate(self, batches: list[list[MicroBatch]]) -> float:
        self.ds.eval()
        means = []
        for micro_batches in batches:
            self.ds.module.start_schedule()
            total = data_parallel_sum(
                [float(model_loss(self.ds, batch).float().mean()) for batch in micro_batches]
            )
            means.append(float(total[0] / total[1]))
        self.ds.train()
        return sum(means) / len(means)

    # --- checkpoints -----------------------------------------------------------------
    def _layout(self) -> dict:
        return dict(current_layout(), zero_stage=self.zero_stage)

    def _state_tensors(self) -> list:
        """This rank's parameters (its ZeRO-3 partitions) and ZeRO optimizer state."""
        tensors = [
            (name, _own_elements(param)) for name, param in self.ds.module.named_parameters()
        ]
        return tensors + optimizer_tensors(
            getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)
        )

    def save(
        self,
        root: Path,
        step: int,
        train_state: dict,
        async_queue=None,
        on_published: Optional[Callable[[Path], None]] = None,
    ) -> Path:
        """Collective. DeepSpeed writes its shards into ``step_N.incomplete``; the engine file
        goes in last and the directory is published like a Megatron checkpoint."""
        if async_queue is not None:
            raise ValueError("the DeepSpeed engine saves synchronously (checkpoint.async_save)")
        check_finite(self._state_tensors(), "parameters and optimizer state")
        final = root / step_dir_name(step)
        staging = root / (final.name + INCOMPLETE)
        if dist.get_rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)
        dist.barrier()
        state = dict(train_state, step=step, layout=self._layout(), **recorded_checksums())
        self.ds.save_checkpoint(
            str(root),
            tag=staging.name,
            save_latest=False,
            client_state={
                "train_state": state,
                "scheduler": self.scheduler.state_dict(),
                "rng_state": capture_rng(),
            },
        )
        dist.barrier()
        if dist.get_rank() == 0:
            # What `t2train ckpt inspect` and the resume checks read, without unpickling.
            summary = {
                key: state.get(key)
                for key in (
                    "step",
                    "tokens",
                    "layout",
                    "config",
                    "config_format",
                    "code_version",
                    "tokenizer_sha256",
                    "bos_id",
                    "checksums",
                )
            }
            (staging / ENGINE_FILE).write_text(
                json.dumps(dict(summary, engine="deepspeed", has_optimizer=True), indent=1)
            )
        publish_checkpoint(root, staging, final, on_published)
        return final

    def load(self, path: Path) -> dict:
        """Collective: model, ZeRO optimizer shards, schedule, RNG; returns the train state.

        DeepSpeed shards resume at the layout that wrote them (TP, DP, ZeRO stage); changing
        it is refused before anything is read (the Megatron engine's checkpoints reshard).
        """
        check_engine(path, "deepspeed")
        written = json.loads((path / ENGINE_FILE).read_text())
        check_same_model(path, written, self.config.model)
        if written["layout"] != self._layout():
            raise CheckpointError(
                f"{path}: DeepSpeed checkpoint of layout {written['layout']}, "
                f"this run is {self._layout()}; DeepSpeed engine checkpoints "
                "resume at the layout (and deepspeed.zero_stage) they were "
                "written with"
            )
        try:
            loaded, client = self.ds.load_checkpoint(
                str(path.parent), tag=path.name, load_lr_scheduler_states=False
            )
        except Exception as err:  # DeepSpeed raises many types for unreadable shards
            raise CheckpointError(
                f"{path}: cannot load the DeepSpeed checkpoint ({type(err).__name__}: {err})"
            ) from err
        if loaded is None:
            raise CheckpointError(f"{path}: DeepSpeed found no checkpoint to load")
        self.scheduler.load_state_dict(client["scheduler"])
        restore_rng(client["rng_state"])
        return client["train_state"]

    # --- facts for logging -----------------------------------------------------------
    def param_norm(self) -> float:
        """Below ZeRO-3 every rank holds whole parameters; ZeRO-3 sums the partitions."""
        if self.zero_stage < 3:
            return param_norm(self.model)

        squares = torch.zeros((), dtype=torch.float64, device=self.ds.device)
        for param in self.ds.module.parameters():
            if param_is_not_tensor_parallel_duplicate(param):
                squares += (
                    torch.linalg.vector_norm(param.ds_tensor.detach(), dtype=torch.float32) ** 2
                )
        dist.all_reduce(squares, group=ps.get_data_parallel_group())
        dist.all_reduce(squares, group=ps.get_tensor_model_parallel_group())
        return float(squares) ** 0.5

    def num_parameters(self) -> int:
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.ds.module.parameters())

    def describe(self) -> str:
        return f"deepspeed ZeRO-{self.config.deepspeed.zero_stage}"
