"""A tiny model trained with the Triton kernels equals the same model with the references,
and the kernels demonstrably ran: the dispatch counted every call the model makes, and the
loss's backward runs each kernel's backward."""

import pytest
import torch

from t2train.config.loader import load_config
from t2train.kernels import dispatch
from t2train.model.build import build_model_chunks, transformer_config

from kernel_checks import BACKWARD_NODES, graph_nodes

LAYERS = 2
BASE = [
    "data.path=unused",
    f"model.num_layers={LAYERS}",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.seq_length=8",
    "model.tie_embeddings=false",
]
# variant -> (overrides, {kernel it uses: its calls per forward})
VARIANTS = {
    "standard+shortswa": (
        ["model.residual=standard", "model.shortswa.window=4"],
        {"window_attention": LAYERS},
    ),
    "depth_attn": (
        ["model.residual=depth_attn", "model.depth_attn.window=2"],
        {"window_attention": LAYERS},
    ),
    # a delta write per sublayer, and its two gate logits (beta, v)
    "ddl": (["model.residual=ddl"], {"delta_write": 2 * LAYERS, "fp32_linear": 4 * LAYERS}),
    "ddl_dv4": (
        ["model.residual=ddl", "model.ddl.dv=4"],
        {"delta_write": 2 * LAYERS, "fp32_linear": 4 * LAYERS},
    ),
    # the mixer's window attention, and a delta write on each of its 3 sublayers per layer
    "ddl+shortswa": (
        ["model.residual=ddl", "model.shortswa.window=4"],
        {"window_attention": LAYERS, "delta_write": 3 * LAYERS, "fp32_linear": 6 * LAYERS},
    ),
    # Blocks of 2 sublayers (one per layer): the block's first read runs phase 1 for both of
    # its reads, the second read phase 2; the final read mixes everything in one call.
    "block_attnres": (
        ["model.residual=block_attnres", "model.attnres.block_size=2"],
        {"block_phase_1": LAYERS, "block_phase_2": LAYERS, "depth_mix": 1},
    ),
    # Dynamic hyper-connections: each sublayer's stream read and write (its logits are
    # PyTorch, recomputed in the backward).
    "hc": (
        ["model.residual=hc", "model.hc.dynamic=true"],
        {"hc_read": 2 * LAYERS, "hc_write": 2 * LAYERS},
    ),
    # The fused read and write (Sinkhorn included) on every sublayer; few iterations, since
    # the interpreter runs them token by token.
    "mhc": (
        ["model.residual=mhc", "model.mhc.sinkhorn_iterations=5"],
        {"stream_read": 2 * LAYERS, "stream_write": 2 * LAYERS},
    ),
}
STEPS = 2


def _train(variant: str) -> tuple[list[float], list[torch.Tensor], set[str]]:
    """Losses, final parameters, and the autograd nodes of the first loss."""
    config = load_config(overrides=BASE + VARIANTS[variant][0])
    torch.manual_seed(0)
    [model] = build_model_chunks(config, transformer_config(config), vocab_size=64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).expand(2, 8)
    losses, nodes = [], set()
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
        nodes = nodes or graph_nodes(loss)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], nodes


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernels_train_like_the_references(megatron_world, monkeypatch, variant):
    _, calls = VARIANTS[variant]
    monkeypatch.setenv("T2_KERNELS", "torch")
    dispatch.reset_launches()
    losses, params, nodes = _train(variant)
    assert not dispatch.launches
    assert not any(nodes & BACKWARD_NODES[kernel] for kernel in calls)

    monkeypatch.setenv("T2_KERNELS", "triton")
    kernel_losses, kernel_params, kernel_nodes = _train(variant)
    assert dict(dispatch.launches) == {kernel: count * STEPS for kernel, count in calls.items()}
    for kernel in calls:
        assert kernel_nodes & BACKWARD_NODES[kernel], f"{kernel}'s backward is not in the graph"

    assert kernel_losses == pytest.approx(losses, rel=1e-5)
    assert losses[-1] != losses[0]  # the steps moved the model
    for ours, theirs in zip(kernel_params, params):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
