"""What both engines use: the loss of one micro-batch, the loss summed over data-parallel
replicas, and the optimizer's settings and LR schedule (Megatron-core's, whichever engine
steps the optimizer)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from t2train.config.schema import Config
from t2train.model.build import compute_dtype
from t2train.parallel.init import current_device


def model_loss(model, batch: dict) -> torch.Tensor:  # batch: a MicroBatch (interface.py)
    """One micro-batch through a model (chunk): per-token loss [b, s] on the last stage."""
    tokens, labels = batch["tokens"], batch["labels"]
    b, s = tokens.shape
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return model(tokens, position_ids, None, labels=labels)


def data_parallel_sum(losses: list) -> torch.Tensor:
    """(sum, count) of these micro-batch losses (floats or 0-dim tensors) over all
    data-parallel replicas."""
    total = torch.zeros(2, dtype=torch.float64, device=current_device())
    if losses:
        total[0] = torch.stack(
            [torch.as_tensor(loss, dtype=torch.float64, device=current_device()) for loss in losses]
        ).sum()
        total[1] = len(losses)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return total


def optimizer_config(config: Config) -> OptimizerConfig:
    train = config.train
    return OptimizerConfig(
        optimizer="adam",
        lr=train.lr,
        min_lr=train.min_lr,
        weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        adam_eps=train.adam_eps,
        clip_grad=train.clip_grad,
        bf16=compute_dtype(config) == torch.bfloat16,
        params_dtype=compute_dtype(config),
        use_distributed_optimizer=config.parallel.distributed_optimizer,
    )


class LRSchedule(OptimizerParamScheduler):
    """Megatron's scheduler, whose state also holds the WSD decay (Megatron's leaves it out, so
    a resumed run would silently take its config's) and whose load sets the step count rather
    than adding to it."""

    wsd_decay_steps: int  # lr_scheduler passes both for every style
    lr_wsd_decay_style: str

    def state_dict(self) -> dict:
        return dict(
            super().state_dict(),
            wsd_decay_steps=self.wsd_decay_steps,
            lr_wsd_decay_style=self.lr_wsd_decay_style,
        )

    def load_state_dict(self, state_dict: dict) -> None:
        self.num_steps = 0
        # Before Megatron's load, which sets the LRs; checkpoints from before
        # train.lr_decay_style are cosine and lack them.
        if "wsd_decay_steps" in state_dict:
            self.wsd_decay_steps = self._check_and_set(
                self.wsd_decay_steps, state_dict["wsd_decay_steps"], "WSD decay steps"
            )
            self.lr_wsd_decay_style = self._check_and_set(
                self.lr_wsd_decay_style, state_dict["lr_wsd_decay_style"], "WSD decay style"
            )
        super().load_state_dict(state_dict)


def lr_scheduler(optimizer, config: Config) -> LRSchedule:
    """Linear warm-up from 0, then ``train.lr_decay_style`` (Megatron's scheduler, which also
    applies each parameter group's ``wd_mult``: no weight decay on biases and norms). Loading
    a checkpoint keeps its schedule or this config's, as ``train.schedule_on_resume`` says."""
    train = config.train
    return LRSchedule(
        optimizer,
        init_lr=0.0,
        max_lr=train.lr,
        min_lr=train.min_lr,
        lr_warmup_steps=train.warmup_steps,
        lr_decay_steps=train.steps,
        lr_decay_style="WSD" if train.lr_decay_style == "wsd" else train.lr_decay_style,
        start_wd=train.weight_decay,
        end_wd=train.weight_decay,
        wd_incr_steps=train.steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=train.schedule_on_resume == "checkpoint",
        override_opt_param_scheduler=train.schedule_on_resume == "config",
        # Read only by WSD; set for every style so a checkpoint's state is complete.
        wsd_decay_steps=train.wsd_decay_steps(),
        lr_wsd_decay_style=train.lr_wsd_decay_style,
    )
