"""DeepSpeed's JSON config, generated from t2train's config (the one source of truth).

Every field t2train sets is listed in ``_owned`` with the t2train field it comes from. A user
JSON (``deepspeed.config_file``) may add any other DeepSpeed field; if it sets an owned field
to a different value, the run stops and names both places instead of silently picking one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from t2train.config.loader import flatten
from t2train.config.schema import Config, ConfigError
from t2train.model.build import compute_dtype


def _cuda_toolkit() -> bool:
    """Whether DeepSpeed can JIT-build its CUDA ops here (it needs nvcc under CUDA_HOME)."""
    from torch.utils.cpp_extension import CUDA_HOME  # noqa: PLC0415 - torch's extension builder: DeepSpeed runs only

    return CUDA_HOME is not None and (Path(CUDA_HOME) / "bin" / "nvcc").exists()


def _owned(config: Config, dp_size: int) -> dict[str, tuple[Any, str]]:
    """Dotted DeepSpeed key -> (value, the t2train field that decides it)."""
    train, ds = config.train, config.deepspeed
    cuda = torch.cuda.is_available()
    bf16 = compute_dtype(config) == torch.bfloat16
    micro_batches = config.micro_batches_per_step(dp_size)
    owned = {
        "train_batch_size": (train.global_batch_size, "train.global_batch_size"),
        "train_micro_batch_size_per_gpu": (train.micro_batch_size, "train.micro_batch_size"),
        "gradient_accumulation_steps": (micro_batches, "train.global_batch_size"),
        "gradient_clipping": (train.clip_grad, "train.clip_grad"),
        "bf16.enabled": (bf16, "train.precision"),
        "fp16.enabled": (False, "train.precision"),
        "optimizer.type": ("AdamW", "train.engine"),
        "optimizer.params.lr": (train.lr, "train.lr"),
        "optimizer.params.betas": (
            [train.adam_beta1, train.adam_beta2],
            "train.adam_beta1/adam_beta2",
        ),
        "optimizer.params.eps": (train.adam_eps, "train.adam_eps"),
        "optimizer.params.weight_decay": (train.weight_decay, "train.weight_decay"),
        # torch's AdamW on the CPU, and on GPUs without the CUDA toolkit to JIT-build
        # DeepSpeed's fused Adam (a pip-installed torch brings no nvcc); else the fused Adam
        "optimizer.params.torch_adam": (not (cuda and _cuda_toolkit()), "train.engine"),
        "zero_optimization.stage": (ds.zero_stage, "deepspeed.zero_stage"),
        "steps_per_print": (10**9, "train.log_interval"),  # t2train logs, not DeepSpeed
        "wall_clock_breakdown": (False, "log"),
    }
    owned["zero_optimization.offload_optimizer.device"] = (
        "cpu" if ds.offload_optimizer else "none",
        "deepspeed.offload_optimizer",
    )
    if bf16:  # skip updates with non-finite gradients, as ZeRO does in fp32
        owned["bf16.check_grad_overflow"] = (True, "train.max_skipped_steps")
    if ds.zero_stage == 3:
        owned["zero_optimization.offload_param.device"] = (
            "cpu" if ds.offload_params else "none",
            "deepspeed.offload_params",
        )
    return owned


# DeepSpeed sections t2train replaces: a user JSON must not bring them.
_REPLACED = {
    "scheduler": "train.lr, train.min_lr, train.warmup_steps and train.lr_decay_style "
    "(t2train runs Megatron's schedule)"
}


def _nest(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for dotted, value in flat.items():
        *parents, leaf = dotted.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def read_user_config(path: str) -> dict:
    file = Path(path)
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"deepspeed.config_file={path!r}: no such file") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"deepspeed.config_file={path!r}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"deepspeed.config_file={path!r}: must hold a JSON object")
    return data


def deepspeed_config(config: Config, dp_size: int) -> dict:
    """The config passed to ``deepspeed.initialize`` (``dp_size``: data-parallel ranks)."""
    if (
        config.deepspeed.offload_optimizer or config.deepspeed.offload_params
    ) and not torch.cuda.is_available():
        field = "offload_optimizer" if config.deepspeed.offload_optimizer else "offload_params"
        raise ConfigError(
            f"deepspeed.{field}=true: offloading moves state from GPU memory to "
            "the host; without CUDA everything is already on the host"
        )
    owned = _owned(config, dp_size)
    merged = {key: value for key, (value, _) in owned.items()}
    if config.deepspeed.config_file:
        user = flatten(read_user_config(config.deepspeed.config_file))
        conflicts = [
            f"{key}={user[key]!r} (t2train sets {value!r} from {source})"
            for key, (value, source) in owned.items()
            if key in user and user[key] != value
        ]
        conflicts += [
            f"{key} (replaced by {source})"
            for key, source in _REPLACED.items()
            if any(name == key or name.startswith(key + ".") for name in user)
        ]
        if conflicts:
            raise ConfigError(
                f"deepspeed.config_file={config.deepspeed.config_file!r} conflicts "
                "with t2train's config: "
                + "; ".join(conflicts)
                + ". Set these in t2train's config, or drop them from the JSON"
            )
        merged.update(user)
    return _nest(merged)
