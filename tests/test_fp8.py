"""train.precision=fp8: the config, which GEMMs become float8, checkpoints shared with bf16 runs,
and the refusal without an FP8 GPU.

The float8 GEMMs run here under torchao's emulation (``emulate=True``: the operands are cast to
float8 and back, the product is taken in high precision), the CPU's stand-in for
torch._scaled_mm, which needs a GPU with FP8.
"""

from dataclasses import replace

import pytest
import torch
from compile_breaks import graph_breaks

from t2train.config.loader import load_config
from t2train.errors import ConfigError
from t2train.model.build import build_model_chunks, compute_dtype, transformer_config
from t2train.residual import registered

TINY = [
    "data.path=unused",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
]
VOCAB = 128


def _config(*extra: str):
    return load_config(overrides=TINY + list(extra))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_config_loads_with_either_recipe(recipe):
    config = _config("train.precision=fp8", f"train.fp8_recipe={recipe}")
    assert (config.train.precision, config.train.fp8_recipe) == ("fp8", recipe)
    assert compute_dtype(config) == torch.bfloat16  # weights and activations stay bf16


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["train.precision=fp16"],
            "train.precision='fp16': must be one of ['auto', 'fp32', 'bf16', 'fp8']",
        ),
        (
            ["train.precision=fp8", "train.fp8_recipe=blockwise"],
            "train.fp8_recipe='blockwise': must be one of ['tensorwise', 'rowwise']",
        ),
        (
            ["train.precision=fp8", "model.seq_length=12", "train.micro_batch_size=1"],
            "train.micro_batch_size=1: with train.precision=fp8 model.seq_length x "
            "train.micro_batch_size = 12 tokens per micro-batch must be a multiple of 16",
        ),
        (
            ["train.precision=fp8", "train.engine=deepspeed"],
            "train.precision='fp8': is not supported with train.engine=deepspeed (the float8 "
            "GEMMs are built and checked with train.engine=megatron)",
        ),
    ],
)
def test_bad_fp8_settings_are_refused_in_one_line(extra, message):
    with pytest.raises(ConfigError) as raised:
        _config(*extra)
    assert str(raised.value) == message


def test_fp8_without_torchao_names_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name)
    )
    with pytest.raises(ConfigError, match=r"^train.precision='fp8': needs the torchao package: "):
        _config("train.precision=fp8")


def _emulated(recipe: str):
    from t2train.nn.float8 import recipe_config

    return replace(recipe_config(recipe), emulate=True)


# Per layer: the attention's, the MLP's and the local mixer's (pre_attention) projections.
LAYER_GEMMS = [
    f"{sublayer}.{linear}"
    for sublayer, linears in (
        ("self_attention", ("linear_qkv", "linear_proj")),
        ("mlp", ("linear_fc1", "linear_fc2")),
        ("pre_attention", ("linear_qkv", "linear_proj")),
    )
    for linear in linears
]


@pytest.mark.parametrize("design", registered())
def test_only_the_attention_and_mlp_gemms_become_float8(megatron_world, design):
    """Every design with the local mixer: its attention's and MLP's four projections and the
    mixer's two convert; the designs' own projections (depth_attn's Megatron linears, ddl's
    nn.Linear gates), the norms, the embedding and the output layer keep their class."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from t2train.nn.float8 import (
        Float8ColumnParallelLinear,
        Float8RowParallelLinear,
        convert_to_float8,
    )

    config = _config(
        f"model.residual={design}",
        "model.shortswa.window=4",
        "model.attnres.block_size=3",  # 3 sublayers per layer
        "model.tie_embeddings=false",
    )
    [model] = build_model_chunks(config, transformer_config(config), VOCAB)
    before = {name: type(module) for name, module in model.named_modules()}
    names = convert_to_float8(model, _emulated("tensorwise"))

    assert set(names) == {f"decoder.layers.{i}.{gemm}" for i in range(2) for gemm in LAYER_GEMMS}
    after = {name: type(module) for name, module in model.named_modules()}
    assert after.keys() == before.keys()
    for name in names:
        float8 = {
            ColumnParallelLinear: Float8ColumnParallelLinear,
            RowParallelLinear: Float8RowParallelLinear,
        }[before[name]]
        assert after[name] is float8
    unchanged = {name for name in after if name not in names}
    assert {name: after[name] for name in unchanged} == {name: before[name] for name in unchanged}
    assert before["output_layer"] is ColumnParallelLinear
    if design == "depth_attn":
        assert after["decoder.layers.0.layer_entry.linear_q"] is ColumnParallelLinear
    if design == "ddl":
        assert after["decoder.layers.0.attn_residual.v_proj"] is torch.nn.Linear


def _loss_and_grads(model):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=g)
    positions = torch.arange(16).expand(2, 16)
    loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _built(config):
    torch.manual_seed(0)
    [model] = build_model_chunks(config, transformer_config(config), VOCAB)
    return model


def test_float8_gemms_without_casts_are_megatrons(megatron_world):
    """With every cast of the recipe off, torchao's matmul is a plain one: the converted model
    (biases on the QKV projection included) gives Megatron's loss and gradients, so only the
    casts differ from a bf16 run."""
    from torchao.float8 import CastConfig, Float8LinearConfig, ScalingType

    from t2train.nn.float8 import convert_to_float8

    config = _config("model.qkv_bias=true")
    off = CastConfig(scaling_type=ScalingType.DISABLED)
    reference = _loss_and_grads(_built(config))
    model = _built(config)
    casts_off = dict(cast_config_input=off, cast_config_weight=off, cast_config_grad_output=off)
    convert_to_float8(model, Float8LinearConfig(**casts_off))
    loss, grads = _loss_and_grads(model)
    assert loss == pytest.approx(reference[0], rel=1e-6)
    for name, grad in reference[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_float8_training_stays_near_high_precision(megatron_world, recipe):
    """One forward and backward with float8 operands (e4m3 forward, e5m2 gradients for
    tensorwise; e4m3 everywhere for rowwise): the loss within 1% of fp32's, every gradient
    finite and within 15% of fp32's in norm."""
    from t2train.nn.float8 import convert_to_float8

    config = _config()
    reference = _loss_and_grads(_built(config))
    model = _built(config)
    convert_to_float8(model, _emulated(recipe))
    loss, grads = _loss_and_grads(model)
    assert loss == pytest.approx(reference[0], rel=0.01)
    for name, grad in reference[1].items():
        assert torch.isfinite(grads[name]).all(), name
        assert float((grads[name] - grad).norm() / grad.norm()) < 0.15, name


def test_float8_layers_compile_to_one_graph_equal_to_eager(megatron_world):
    """The fused path compiles the converted layers (``aot_eager`` here: dynamo's graphs
    without generating kernels): one graph for both layers, no break, eager's numbers."""
    from torch._dynamo.utils import counters

    from t2train.nn.compiling import compile_modules
    from t2train.nn.float8 import convert_to_float8

    config = _config("train.precision=bf16")
    results = []
    for compiled in (False, True):
        model = _built(config)
        convert_to_float8(model, _emulated("tensorwise"))
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            compile_modules(model.decoder.layers, backend="aot_eager")
        results.append(_loss_and_grads(model))
    assert graph_breaks(counters) == {}
    assert counters["stats"]["unique_graphs"] == 1
    (eager_loss, eager_grads), (loss, grads) = results
    assert loss == eager_loss
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0)


def test_checkpoints_are_shared_between_fp8_and_bf16_models(megatron_world, tmp_path):
    """The same state dict and sharded (dist-checkpointing) keys; a bf16 model's weights saved
    with Megatron's dist checkpointing load into an fp8 one and back, unchanged."""
    from megatron.core import dist_checkpointing

    from t2train.compat.megatron_writer import results_in_process
    from t2train.nn.float8 import convert_to_float8

    config = _config("train.precision=bf16")
    bf16 = _built(config)
    fp8 = _built(config)
    convert_to_float8(fp8, _emulated("tensorwise"))
    assert fp8.state_dict().keys() == bf16.state_dict().keys()
    assert fp8.sharded_state_dict().keys() == bf16.sharded_state_dict().keys()
    assert all(p.dtype == torch.bfloat16 for p in fp8.parameters())

    for source, target, folder in ((bf16, fp8, "from_bf16"), (fp8, bf16, "from_fp8")):
        with torch.no_grad():
            for param in source.parameters():
                param.add_(0.01 * torch.randn_like(param))
        (tmp_path / folder).mkdir()
        with results_in_process():
            dist_checkpointing.save({"model": source.sharded_state_dict()}, tmp_path / folder)
        loaded = dist_checkpointing.load({"model": target.sharded_state_dict()}, tmp_path / folder)
        target.load_state_dict(loaded["model"])
        got = target.state_dict()
        for name, want in source.state_dict().items():
            if isinstance(want, torch.Tensor):  # not Megatron's empty _extra_state entries
                assert torch.equal(got[name], want), name


def _gpu(monkeypatch, capability, name="NVIDIA A100-SXM4-80GB"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)


def test_fp8_is_refused_without_a_gpu_with_fp8(monkeypatch):
    from t2train.nn.float8 import require_fp8_device

    config = _config("train.precision=fp8")
    needs = (
        "train.precision='fp8': needs a GPU with FP8 (compute capability 8.9+, "
        "H100/H200/L40S/RTX 4090); this machine has "
    )
    with pytest.raises(ConfigError) as raised:  # the run's own path, on this CPU machine
        build_model_chunks(config, transformer_config(config), VOCAB)
    assert str(raised.value) == needs + "no CUDA device"

    _gpu(monkeypatch, (8, 0))
    with pytest.raises(ConfigError) as raised:
        require_fp8_device()
    assert str(raised.value) == needs + "NVIDIA A100-SXM4-80GB (compute capability 8.0)"
    for capability in ((8, 9), (9, 0), (10, 0)):
        _gpu(monkeypatch, capability, "an FP8 GPU")
        require_fp8_device()


def test_gemm_shapes_torch_scaled_mm_cannot_take_are_refused(megatron_world):
    from t2train.nn.float8 import convert_to_float8

    config = _config("model.hidden_size=72", "model.num_attention_heads=4")
    model = _built(config)
    with pytest.raises(ConfigError) as raised:
        convert_to_float8(model, _emulated("tensorwise"))
    assert str(raised.value) == (
        "train.precision='fp8': decoder.layers.0.self_attention.linear_qkv is 216 x 72 on each "
        "tensor-parallel rank; float8 GEMMs need both dimensions multiples of 16 "
        "(torch._scaled_mm)"
    )


@pytest.mark.slow
def test_float8_gemms_under_tensor_parallelism(tmp_path):
    """TP=2 on gloo, with and without sequence parallelism: without casts the converted model
    gives Megatron's loss and gradients, so the all-gather, reduce-scatter and all-reduce sit
    where Megatron's own linears put them; emulated tensorwise float8 stays near."""
    from torchrun_helper import run_torchrun

    result = run_torchrun("fp8_tensor_parallel.py", 2, [], tmp_path / "result.json")
    for layout in ("tp2", "tp2_sp"):
        assert result[layout]["plain_loss_diff"] < 1e-6, layout
        assert result[layout]["plain_grad_diff"] < 1e-5, layout
        assert result[layout]["float8_loss_rel"] < 0.01, layout
        assert result[layout]["converted"] == 8
