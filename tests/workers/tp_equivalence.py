"""TP=2 forward/backward equals TP=1 on the same weights and batch (run on 2 ranks).

The TP=1 model's weights are saved with Megatron dist-checkpointing and loaded into the
TP=2 model (resharding, including SwiGLU's interleaved fc1). Gradients of both layouts are
written the same way and read back into one TP=1 layout for an element-wise comparison.
"""

from __future__ import annotations

import torch.distributed as dist
from common import finish, fixed_batch, parse_args, use_layout, write_result
from megatron.core import dist_checkpointing

from t2train.compat.megatron_writer import results_in_process
from t2train.config.loader import load_config
from t2train.model.build import build_model_chunks, transformer_config
from t2train.parallel.init import init_distributed, set_seed

VOCAB = 256


def build(tp: int, extra: list[str]):
    topology = use_layout(tp, 1, 1)
    set_seed(7, topology)
    config = load_config(
        "tiny",
        overrides=["data.path=unused", "model.seq_length=32", f"parallel.tensor={tp}", *extra],
    )
    [model] = build_model_chunks(config, transformer_config(config), VOCAB)
    return model


def save(model, path: str, grads: bool) -> None:
    if grads:
        for p in model.parameters():
            p.data.copy_(p.grad)
    if dist.get_rank() == 0:
        import os

        os.makedirs(path, exist_ok=True)
    dist.barrier()
    with results_in_process():  # as a trainer's synchronous save
        dist_checkpointing.save({"model": model.sharded_state_dict()}, path)


def load(model, path: str) -> None:
    model.load_state_dict(
        dist_checkpointing.load({"model": model.sharded_state_dict()}, path)["model"]
    )


def loss_and_backward(model) -> float:
    tokens, labels, positions = fixed_batch(VOCAB, 4, 32)
    loss = model(tokens, positions, None, labels=labels).mean()
    loss.backward()
    return float(loss)


def main() -> None:
    args = parse_args([("--scratch", str), ("--extra", str)])
    extra = args.extra.split(",") if args.extra else []
    init_distributed()
    reference = build(1, extra)
    save(reference, f"{args.scratch}/weights", grads=False)
    loss_tp1 = loss_and_backward(reference)
    save(reference, f"{args.scratch}/grads_tp1", grads=True)

    sharded = build(2, extra)
    load(sharded, f"{args.scratch}/weights")
    loss_tp2 = loss_and_backward(sharded)
    save(sharded, f"{args.scratch}/grads_tp2", grads=True)

    view = build(1, extra)
    load(view, f"{args.scratch}/grads_tp1")
    grads_tp1 = {n: p.detach().clone() for n, p in view.named_parameters()}
    load(view, f"{args.scratch}/grads_tp2")
    diffs = {n: float((p.detach() - grads_tp1[n]).abs().max()) for n, p in view.named_parameters()}
    scale = max(float(g.abs().max()) for g in grads_tp1.values())
    write_result(
        args.out,
        {"loss_tp1": loss_tp1, "loss_tp2": loss_tp2, "grad_diffs": diffs, "grad_scale": scale},
    )


if __name__ == "__main__":
    main()
    finish()
