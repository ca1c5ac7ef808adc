"""The residual GPT against Megatron-core's stock GPTModel, and one CPU training step."""

import pytest
import torch

from t2train.config.loader import load_config
from t2train.model.build import build_model_chunks, transformer_config
from t2train.residual import registered

from variants import every_design

TINY = [
    "data.path=unused",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=16",
]


def _batch(vocab=128, b=2, s=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(s).expand(b, s)


@pytest.mark.parametrize(
    "extra", [[], ["model.num_query_groups=2"], ["model.tie_embeddings=false"]]
)
def test_standard_matches_megatron_gptmodel(megatron_world, extra):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = load_config(overrides=TINY + extra)
    tf_config = transformer_config(config)
    [ours] = build_model_chunks(config, tf_config, vocab_size=128)
    stock = GPTModel(
        tf_config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=128,
        max_sequence_length=16,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=config.model.tie_embeddings,
    )
    stock.load_state_dict(ours.state_dict(), strict=True)
    tokens, labels, positions = _batch()
    ours_logits = ours(tokens, positions, None)
    stock_logits = stock(tokens, positions, None)
    # Different attention kernels (SDPA vs Megatron's unfused softmax): fp32 rounding only.
    torch.testing.assert_close(ours_logits, stock_logits, atol=1e-5, rtol=1e-5)
    assert ours_logits.shape == (2, 16, 128)


def test_parameter_count_of_standard(megatron_world):
    config = load_config(overrides=TINY)
    [model] = build_model_chunks(config, transformer_config(config), vocab_size=128)
    h, f, layers = 64, config.model.resolved_ffn_hidden_size(), 2
    per_layer = 4 * h * h + 3 * h * f + 2 * h  # qkv + proj, SwiGLU fc1 (2f) + fc2, 2 norms
    expected = 128 * h + layers * per_layer + h  # tied embedding, layers, final norm
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize(
    "variant", [design + mixer for design in registered() for mixer in ("", "+shortswa")]
)
def test_recompute_gives_identical_gradients(megatron_world, variant):
    """Full activation recompute, a checkpoint per layer: the stream is packed into one tensor
    at each layer boundary and rebuilt (``from_units``) before the next, also mid-block for
    Block AttnRes (blocks of 4 sublayers, 2 or 3 per layer), so every design's rebuild runs.
    Bitwise for most designs; where a state's gradient is summed from several uses (Block
    AttnRes' sources, HC's and mHC's streams) the recomputed graph sums in another order:
    equal to fp32 rounding, within 1e-5 of the largest gradient entry."""
    design, _, mixer = variant.partition("+")
    grads = []
    for recompute in ("none", "full"):
        torch.manual_seed(0)
        config = load_config(
            overrides=TINY
            + [
                "model.num_layers=4",
                f"model.residual={design}",
                "model.attnres.block_size=4",
                f"model.shortswa.window={4 if mixer else 0}",
                f"model.recompute={recompute}",
            ]
        )
        [model] = build_model_chunks(config, transformer_config(config), vocab_size=128)
        with torch.no_grad():  # zero-initialised parts (pseudo-queries, depth reads) count too
            for param in model.parameters():
                param.add_(0.02 * torch.randn_like(param))
        tokens, labels, positions = _batch()
        model(tokens, positions, None, labels=labels).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    scale = max(g.abs().max() for g in grads[0].values())
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("variant", every_design())
def test_selective_recompute_gives_identical_loss_and_gradients(megatron_world, variant):
    """Selective recompute (t2train/nn/recompute.py) keeps each layer's GEMM and attention
    outputs and recomputes the rest in the backward, dropout (p = 0.1) included: its masks
    are drawn again from the forward's RNG states, the default generator's and those of
    Megatron's tracker (attention dropout), so loss and gradients equal no recompute's,
    bitwise (eager, fp32)."""
    from t2train.parallel.init import set_seed

    design, _, mixer = variant.partition("+")
    runs = []
    for recompute in ("none", "selective"):
        torch.manual_seed(0)
        config = load_config(
            overrides=TINY
            + [
                f"model.residual={design}",
                f"model.shortswa.window={4 if mixer else 0}",
                "model.dropout=0.1",
                f"model.recompute={recompute}",
            ]
        )
        [model] = build_model_chunks(config, transformer_config(config), vocab_size=128)
        with torch.no_grad():  # zero-initialised parts (pseudo-queries, depth reads) count too
            for param in model.parameters():
                param.add_(0.02 * torch.randn_like(param))
        tokens, labels, positions = _batch()
        set_seed(1, megatron_world)  # the same masks for both: the generator and the tracker
        loss = model(tokens, positions, None, labels=labels).mean()
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss, grads), (selective_loss, selective_grads) = runs
    assert torch.equal(selective_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(selective_grads[name], grad), name
