"""The scalars logged every ``train.log_interval`` steps (the tag table is in docs/monitoring.md).

``StepMeter`` accumulates the steps since the last log (time, data wait) and the run's
counters (skipped updates, consumed tokens: saved in checkpoints and carried over a resume),
and turns them, with the last step's result, into one dict of scalars. Building that dict
is collective (parameter norm, memory): every rank calls ``scalars`` at the same steps.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from t2train.model.build import compute_dtype
from t2train.monitor.mfu import model_flops_per_token, resolve_peak, tflops_per_device
from t2train.monitor.system import memory_gib


def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def loss_scalars(split: str, loss: float) -> dict[str, float]:
    """``train``/``val`` loss and perplexity."""
    return {f"{split}/loss": loss, f"{split}/perplexity": perplexity(loss)}


def param_norm(chunks) -> float:
    """L2 norm of all parameters, each counted once over tensor and pipeline ranks (collective).

    Skips copies: tensor-parallel duplicates (norms, replicated gates) off tensor rank 0 and
    the last stage's copy of tied embeddings.
    """

    device = "cuda" if torch.cuda.is_available() else "cpu"
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for chunk in chunks:
        for param in chunk.parameters():
            if not getattr(param, "shared", False) and param_is_not_tensor_parallel_duplicate(
                param
            ):
                squares += torch.linalg.vector_norm(param.detach(), dtype=torch.float32) ** 2
    dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
    return math.sqrt(float(squares))


class StepMeter:
    """Throughput, TFLOP/s, MFU and timings over the steps since the last ``scalars`` call.

    Time counts data loading and the training step only (not evaluation, checkpoints or
    diagnostics), so tokens/s is the training speed.
    """

    def __init__(
        self,
        tokens_per_step: int,
        devices: int,
        flops_per_token: float,
        peak_tflops: Optional[float],
        counters: Optional[dict] = None,
    ):
        self.tokens_per_step = tokens_per_step
        self.devices = devices
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        counters = counters or {}
        self.skipped_steps = counters.get("skipped_steps", 0)  # in the run, over resumes
        self.tokens = counters.get("tokens", 0)  # consumed by training steps, over resumes
        self._reset_window()

    def counters(self) -> dict[str, int]:
        """What a checkpoint keeps for ``counters`` of the resumed run's meter."""
        return {"skipped_steps": self.skipped_steps, "tokens": self.tokens}

    def _reset_window(self) -> None:
        self.steps = 0
        self.seconds = 0.0
        self.data_wait = 0.0

    def record(self, seconds: float, data_wait: float, skipped: bool) -> None:
        self.steps += 1
        self.seconds += seconds
        self.data_wait += data_wait
        self.skipped_steps += int(skipped)
        self.tokens += self.tokens_per_step

    def scalars(self, result, parameter_norm: float) -> dict[str, float]:
        """Every interval scalar, from the window and the last step's ``StepResult``."""
        tokens_per_sec = self.tokens_per_step * self.steps / max(self.seconds, 1e-9)
        tflops = tflops_per_device(tokens_per_sec, self.flops_per_token, self.devices)
        values = {
            **loss_scalars("train", result.loss),
            "train/lr": result.lr,
            "train/grad_norm": result.grad_norm,
            "train/param_norm": parameter_norm,
            "train/skipped_steps": self.skipped_steps,
            "train/tokens": self.tokens,
            "throughput/tokens_per_sec": tokens_per_sec,
            "throughput/tokens_per_sec_per_device": tokens_per_sec / self.devices,
            "throughput/tflops_per_device": tflops,
            "time/step_seconds": self.seconds / self.steps,
            "time/data_wait_seconds": self.data_wait / self.steps,
            **memory_gib(),
            **result.traffic,
        }
        if self.peak_tflops is not None:
            values["throughput/mfu"] = tflops / self.peak_tflops
        self._reset_window()
        return values


def step_meter(
    config, vocab_size: int, devices: int, counters: Optional[dict] = None
) -> tuple[StepMeter, str]:
    """The run's meter (``counters``: a resumed checkpoint's train state), and a one-line note
    on MFU: the peak it uses, or why there is none."""

    peak, note = resolve_peak(config.log.peak_tflops, compute_dtype(config))
    tokens_per_step = config.train.global_batch_size * config.model.seq_length
    flops = model_flops_per_token(config.model, vocab_size)
    return StepMeter(tokens_per_step, devices, flops, peak, counters), note
