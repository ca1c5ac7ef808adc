"""The residual GPT against Megatron-core's stock GPTModel, and one CPU training step."""

import pytest
import torch

from t2train.config.loader import load_config
from t2train.model.build import build_model_chunks, transformer_config

TINY = ["data.path=unused", "model.num_layers=2", "model.hidden_size=64",
        "model.num_attention_heads=4", "model.seq_length=16"]


def _batch(vocab=128, b=2, s=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(s).expand(b, s)


@pytest.mark.parametrize("extra", [[], ["model.num_query_groups=2"],
                                   ["model.tie_embeddings=false"]])
def test_standard_matches_megatron_gptmodel(megatron_world, extra):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = load_config(overrides=TINY + extra)
    tf_config = transformer_config(config)
    [ours] = build_model_chunks(config, tf_config, vocab_size=128)
    stock = GPTModel(tf_config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=128, max_sequence_length=16, position_embedding_type="rope",
                     share_embeddings_and_output_weights=config.model.tie_embeddings)
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


def test_recompute_gives_identical_gradients(megatron_world):
    grads = []
    for recompute in ("none", "full"):
        torch.manual_seed(0)
        config = load_config(overrides=TINY + [f"model.recompute={recompute}"])
        [model] = build_model_chunks(config, transformer_config(config), vocab_size=128)
        tokens, labels, positions = _batch()
        model(tokens, positions, None, labels=labels).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=0, rtol=0)
