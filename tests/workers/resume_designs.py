"""Train residual variants 2N steps, or resume each from its step-N checkpoint (one rank).

``--phase straight`` trains each design from scratch to 2N, saving at N; ``--phase resume``
(a fresh process) continues each from that checkpoint to 2N. ``--variants`` is JSON:
{name: [config overrides]}. Dropout is on, so the RNG
streams drive the losses. Writes {design: {"losses": {step: loss}, "rng": digest of the RNG
streams saved in the step-2N checkpoint}}.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

from common import parse_args, write_result

from t2train.config.loader import load_config
from t2train.train.loop import train

TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.lr=3e-3",
    "train.min_lr=3e-4",
    "train.warmup_steps=2",
    "train.eval_batches=1",
    "train.eval_interval=1000",
    "train.log_interval=1",
    "log.tensorboard=false",
    "model.dropout=0.1",
]


def saved_rng_digest(checkpoint: Path) -> str:
    """sha256 of every RNG stream a checkpoint holds (python, numpy, torch CPU, tracker)."""
    from megatron.core import dist_checkpointing

    from t2train.engine.megatron.checkpoint import rng_sharded_object

    state = dist_checkpointing.load({"rng_state": rng_sharded_object(None)}, str(checkpoint))
    streams = state["rng_state"][0]
    tensors = [streams["torch"], *(streams["tracker"][name] for name in sorted(streams["tracker"]))]
    plain = pickle.dumps(
        (
            streams["python"],
            [getattr(part, "tolist", lambda p=part: p)() for part in streams["numpy"]],
        )
    )
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in tensors) + plain).hexdigest()


def main() -> None:
    args = parse_args(
        [
            ("--data", Path),
            ("--root", Path),
            ("--phase", str),
            ("--steps-before-save", int),
            ("--variants", json.loads),
        ]
    )
    n = args.steps_before_save
    losses = {}
    for name, design in args.variants.items():
        straight = args.root / name
        common = [
            *TINY,
            *design,
            f"data.path={args.data}",
            f"train.steps={2 * n}",
            f"checkpoint.interval={n}",
        ]
        run_dir = straight if args.phase == "straight" else args.root / (name + "-resumed")
        start = (
            "checkpoint.resume=none"
            if args.phase == "straight"
            else f"checkpoint.resume={straight / 'checkpoints' / f'step_{n:08d}'}"
        )
        summary = train(load_config(overrides=[*common, f"log.run_dir={run_dir}", start]))
        losses[name] = {
            "losses": summary.losses,
            "rng": saved_rng_digest(run_dir / "checkpoints" / f"step_{2 * n:08d}"),
        }
    write_result(args.out, losses)


if __name__ == "__main__":
    main()
