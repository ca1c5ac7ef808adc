"""A tiny model trained with the Triton kernels equals the same model with the references."""

import pytest
import torch

from t2train.config.loader import load_config
from t2train.model.build import build_model_chunks, transformer_config

BASE = ["data.path=unused", "model.num_layers=2", "model.hidden_size=32",
        "model.num_attention_heads=2", "model.seq_length=8", "model.tie_embeddings=false"]
VARIANTS = {
    "ddl+shortswa": ["model.residual=ddl", "model.shortswa.window=4"],
    "depth_attn": ["model.residual=depth_attn", "model.depth_attn.window=2"],
    "ddl": ["model.residual=ddl"],
    "ddl_dv4": ["model.residual=ddl", "model.ddl.dv=4"],
    # Blocks of 2 sublayers: reads alternate phase 1 alone (block start) and both phases.
    "block_attnres": ["model.residual=block_attnres", "model.attnres.block_size=2"],
    # The fused read and write (Sinkhorn included) on every sublayer; few iterations, since
    # the interpreter runs them token by token.
    "mhc": ["model.residual=mhc", "model.mhc.sinkhorn_iterations=5"],
}
STEPS = 2


def _train(variant: str) -> tuple[list[float], list[torch.Tensor]]:
    config = load_config(overrides=BASE + VARIANTS[variant])
    torch.manual_seed(0)
    [model] = build_model_chunks(config, transformer_config(config), vocab_size=64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).expand(2, 8)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernels_train_like_the_references(megatron_world, monkeypatch, variant):
    monkeypatch.setenv("T2_KERNELS", "torch")
    losses, params = _train(variant)
    monkeypatch.setenv("T2_KERNELS", "triton")
    kernel_losses, kernel_params = _train(variant)
    assert kernel_losses == pytest.approx(losses, rel=1e-5)
    assert losses[-1] != losses[0]  # the steps moved the model
    for ours, theirs in zip(kernel_params, params):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
