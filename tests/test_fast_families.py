"""Fast, in-process versions of what only the slow end-to-end tests saw.

* A one-layer Qwen2 (grouped-query attention, non-zero q/k/v biases, norms away from 1) made
  here with random weights and brought in by ``t2train.export.hf_import.import_hf`` gives
  transformers' logits (fp32, 1e-5) when its checkpoint is loaded by
  ``t2train.export.load``; the same model with its biases zeroed gives logits far outside
  that tolerance, so a dropped or misplaced bias would fail.
* A Llama with Llama 3.1's RoPE scaling (rope_type ``llama3``), imported and exported again
  (``import_hf``, then ``t2train.export.hf.export_hf``), has the original ``config.json``
  back, every field equal, and its weights exactly; the inverse frequencies transformers
  computes from the exported config equal those it computes from the original and those the
  t2train model trains with (Megatron's ``RotaryEmbedding``).
* ``model.residual=ddl`` with ``model.ddl.dv=4`` through a whole tiny model with the Triton
  kernels (``T2_KERNELS=triton``, Triton's interpreter on CPU) equals the references
  (``T2_KERNELS=torch``) in the loss and in every parameter's gradient (1e-5 of the largest
  entry of its module's gradients), with every weight moved off its init; the dispatch
  counted the delta writes and the gate-logit kernel, which ran with d_v = 4 outputs (v) as
  well as one (beta).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

TESTS = Path(__file__).parent
VOCAB = 128  # a multiple of make_vocab_size_divisible_by: no padded rows


def _tests_module(relative: str):
    """A helper module of another test folder (``tests/kernels`` or ``tests/residual``), by its
    path, under the name its own folder's tests import it by."""
    path = TESTS / relative
    if path.stem not in sys.modules:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    return sys.modules[path.stem]


def _hf_folder(model, folder: Path) -> Path:
    """``model`` saved as a Hugging Face folder with a small word-level tokenizer (the import
    needs one that defines an end-of-document token)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    model.save_pretrained(folder)
    words = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def _off_init(model) -> None:
    """Norm weights U(0.5, 1.5), biases N(0, 0.5^2): a misplaced norm or bias shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.5)


# --- 1. Qwen2: grouped-query attention and q/k/v biases --------------------------------------


def test_a_qwen2_with_biases_imports_with_transformers_logits(megatron_world, tmp_path):
    """One Qwen2 layer (4 query heads over 2 key/value groups, q/k/v biases N(0, 0.5^2)) after
    ``import_hf``: t2train's logits equal transformers' on 3 sequences of 16 tokens to 1e-5
    (fp32; here they come out bitwise equal). Zeroing the biases moves transformers' logits
    by far more than that, so the comparison sees the biases."""
    from t2train.export.hf_import import import_hf
    from t2train.export.load import load_model, open_checkpoint

    torch.manual_seed(0)
    qwen = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            tie_word_embeddings=False,
        )
    ).eval()
    _off_init(qwen)
    attention = qwen.model.layers[0].self_attn
    biases = [attention.q_proj.bias, attention.k_proj.bias, attention.v_proj.bias]
    assert all(bias.abs().min() > 0 for bias in biases)

    imported = import_hf(_hf_folder(qwen, tmp_path / "qwen2"), tmp_path / "imported")
    assert imported.parameters == sum(p.numel() for p in qwen.parameters())
    ours = load_model(open_checkpoint(imported.out), device="cpu").model
    assert ours.config.add_qkv_bias

    tokens = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ours(tokens, torch.arange(16).unsqueeze(0), None)[..., :VOCAB]
        theirs = qwen(tokens).logits
        without_biases = copy.deepcopy(qwen)
        for module in without_biases.model.layers[0].self_attn.children():
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        unbiased = without_biases(tokens).logits
    torch.testing.assert_close(logits, theirs, rtol=1e-5, atol=1e-5)
    assert (unbiased - theirs).abs().max() > 100 * 1e-5  # the biases matter at this tolerance


# --- 2. Llama 3.1's RoPE scaling through import and export -----------------------------------

# What a Llama config.json says about the model it defines: the original must hold each, so
# that the comparison of every field covers them.
DEFINING = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "dtype",
)


def test_a_rope_scaled_llama_exports_its_config_and_frequencies_back(megatron_world, tmp_path):
    """A Llama with Llama 3.2's RoPE scaling (rope_type llama3, factor 32: not Megatron's
    default 8, so a lost factor shows) through ``import_hf`` and ``export_hf``: the exported
    config.json equals the original in every field (the original's bos/eos ids are set to
    the tokenizer's end-of-document token, which the export writes), the weights come back
    exactly, and the inverse frequencies
    transformers computes from the exported config equal those from the original and the
    t2train model's (``rotary_pos_emb.inv_freq``, what training rotates by), to 1e-6
    relative. With head_dim 16 and rope_theta 5e5 the 8 frequencies cover the three regimes
    of the scaling: 4 kept, 1 interpolated, 3 divided by the factor."""
    from safetensors.torch import load_file
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from t2train.export.hf import export_hf
    from t2train.export.hf_import import import_hf
    from t2train.export.load import load_model, open_checkpoint

    factor, theta, head_dim = 32.0, 500000.0, 16
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=4 * head_dim,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,  # Llama 3.1's; above the original 8192
        rope_theta=theta,
        rope_scaling={
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,  # the tokenizer's end-of-document token, which the export writes
        eos_token_id=0,
    )
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(config).eval()
    _off_init(llama)
    folder = _hf_folder(llama, tmp_path / "llama")
    imported = import_hf(folder, tmp_path / "imported")
    export_hf(imported.out, tmp_path / "back", tokenizer=imported.out / "tokenizer.json")

    original = json.loads((folder / "config.json").read_text())
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert set(DEFINING) <= set(original)
    differing = {
        field: (original.get(field), exported.get(field))
        for field in set(original) | set(exported)
        if original.get(field, KeyError) != exported.get(field, KeyError)
    }
    assert not differing, f"field: (original, exported): {differing}"
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == llama.state_dict().keys()
    for name, tensor in llama.state_dict().items():
        assert torch.equal(back[name], tensor), name

    llama3 = ROPE_INIT_FUNCTIONS["llama3"]
    theirs, scale = llama3(config, "cpu")
    from_export, export_scale = llama3(
        transformers.AutoConfig.from_pretrained(tmp_path / "back"), "cpu"
    )
    ours = load_model(open_checkpoint(imported.out), device="cpu").model.rotary_pos_emb.inv_freq
    assert scale == export_scale == 1.0
    torch.testing.assert_close(from_export, theirs, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert torch.equal(llama.model.rotary_emb.inv_freq, theirs)  # what the Llama rotates by
    unscaled = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    divided_by = (unscaled / ours.double()).tolist()
    assert divided_by[:4] == pytest.approx([1.0] * 4, rel=1e-6)
    assert 1.5 < divided_by[4] < factor - 1.5
    assert divided_by[5:] == pytest.approx([factor] * 3, rel=1e-6)


# --- 3. DDL with d_v > 1 through a whole model with the Triton kernels ----------------------


def _ddl_gradients(variant: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], set[str]]:
    """The loss of one forward of a tiny model built as ``test_kernel_training`` builds it
    (every weight moved off its init by ``built.randomise``), each parameter's gradient after
    its backward, and the autograd nodes of the loss."""
    from t2train.config.loader import load_config
    from t2train.model.build import build_model_chunks, transformer_config

    training = _tests_module("kernels/test_kernel_training.py")
    config = load_config(overrides=training.BASE + training.VARIANTS[variant][0])
    torch.manual_seed(0)
    [model] = build_model_chunks(config, transformer_config(config), vocab_size=64)
    _tests_module("residual/built.py").randomise(model, seed=0)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).expand(2, 8)
    loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
    nodes = _tests_module("kernels/kernel_checks.py").graph_nodes(loss)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, nodes


def test_ddl_with_four_state_columns_runs_the_kernels_like_the_references(
    megatron_world, monkeypatch
):
    """``model.residual=ddl model.ddl.dv=4`` (2 layers): the loss and every parameter's
    gradient with ``T2_KERNELS=triton`` equal those with ``T2_KERNELS=torch`` to 1e-5 of the
    largest entry of the module's gradients (a gate's bias is judged with its weight, below),
    every gradient non-zero. The kernels ran: per sublayer one delta write of
    a 4-column state and two gate-logit (``fp32_linear``) calls, beta's with one output and
    v's with d_v = 4 (read from the dispatch's launches), and the loss's graph holds both
    kernels' backward nodes; with ``torch`` nothing was launched."""
    from t2train.kernels import dispatch

    checks = _tests_module("kernels/kernel_checks.py")
    training = _tests_module("kernels/test_kernel_training.py")
    variant = "ddl_dv4"
    assert "model.ddl.dv=4" in training.VARIANTS[variant][0]
    sublayers = 2 * training.LAYERS
    widths: list[tuple[str, int]] = []  # (kernel, outputs) of each launch
    launch = dispatch._launch

    def recorded(kernel, *args, **kwargs):
        if kernel.name == "fp32_linear":  # (x, weight [outputs, h], bias)
            widths.append((kernel.name, args[1].shape[0]))
        elif kernel.name == "delta_write":  # (state, out, beta_logit, v_logit [..., d_v], ...)
            widths.append((kernel.name, args[3].shape[-1]))
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(dispatch, "_launch", recorded)

    monkeypatch.setenv("T2_KERNELS", "torch")
    dispatch.reset_launches()
    loss, grads, nodes = _ddl_gradients(variant)
    assert not dispatch.launches and not widths
    assert not nodes & (checks.BACKWARD_NODES["delta_write"] | checks.BACKWARD_NODES["fp32_linear"])

    monkeypatch.setenv("T2_KERNELS", "triton")
    kernel_loss, kernel_grads, kernel_nodes = _ddl_gradients(variant)
    assert dict(dispatch.launches) == {"delta_write": sublayers, "fp32_linear": 2 * sublayers}
    assert sorted(widths) == sorted(
        [("delta_write", 4)] * sublayers
        + [("fp32_linear", 1)] * sublayers
        + [("fp32_linear", 4)] * sublayers
    )
    for kernel in ("delta_write", "fp32_linear"):
        assert kernel_nodes & checks.BACKWARD_NODES[kernel], f"{kernel}'s backward did not run"

    assert abs(kernel_loss - loss) <= 1e-5 * abs(loss)
    assert kernel_grads.keys() == grads.keys()
    # A gate's bias is judged with its weight, as the one matrix [W | b] its Linear applies to
    # [x; 1]: alone, a bias's gradient is a sum over the tokens that cancels, where the fp32
    # reference itself is up to 2.5e-5 of it away from the fp64 result (measured; the
    # kernel 2e-5), while the whole matrix's largest entry is the sum's scale.
    largest: dict[str, torch.Tensor] = {}
    for name, grad in grads.items():
        module = name.rsplit(".", 1)[0]
        largest[module] = torch.maximum(largest.get(module, grad.new_zeros(())), grad.abs().max())
    for name, grad in grads.items():
        assert grad.abs().max() > 0, f"{name}: zero gradient"
        scale = largest[name.rsplit(".", 1)[0]]
        error = (kernel_grads[name] - grad).abs().max()
        assert error <= 1e-5 * scale, f"{name}: {error:.2e} of {scale:.2e}"
