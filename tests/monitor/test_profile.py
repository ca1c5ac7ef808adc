"""``log.profile_steps``: a run writes a torch.profiler trace of the chosen steps that names
its layers and its Triton kernels (t2train/monitor/profiler.py); the settings are checked."""

from __future__ import annotations

import json

import pytest

from t2train.config.loader import load_config
from t2train.config.schema import ConfigError

TINY_MODEL = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.warmup_steps=1",
    "train.eval_batches=1",
    "log.diagnostics_interval=0",
]


@pytest.mark.slow
def test_a_profiled_run_writes_a_trace_naming_layers_and_kernels(
    megatron_world, shakespeare, tmp_path, monkeypatch
):
    """Steps 2-3 of a 4-step `ddl` run, its Triton kernels on (the interpreter): one Chrome
    trace (what Perfetto and TensorBoard's profiler plugin read) with both decoder layers'
    regions, the delta write's forward and backward operators and the optimizer step, each
    region once per traced step."""
    from t2train.train.loop import train

    monkeypatch.setenv("T2_KERNELS", "triton")
    run_dir = tmp_path / "run"
    train(
        load_config(
            overrides=[
                *TINY_MODEL,
                f"data.path={shakespeare}",
                f"log.run_dir={run_dir}",
                "model.residual=ddl",
                "train.steps=4",
                "train.eval_interval=4",
                "log.profile_steps=2-3",
            ]
        )
    )
    [trace] = (run_dir / "profile").iterdir()
    assert trace.name == "rank0.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = [event.get("name", "") for event in events if event.get("ph") == "X"]
    assert all(
        {"ts", "dur", "pid", "tid"} <= set(event) for event in events if event.get("ph") == "X"
    )
    micro_batches = 2 * 1  # two steps of one micro-batch
    assert names.count("t2train layer 1") == names.count("t2train layer 2") == micro_batches
    assert names.count("t2train::delta_write") >= 2 * micro_batches  # two sublayers
    assert "t2train::delta_write_backward" in names
    assert sum(name.startswith("Optimizer.step") for name in names) == 2


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("log.profile_steps", "3-2", "a step N or a range FIRST-LAST"),
        ("log.profile_steps", "x", "a step N or a range FIRST-LAST"),
        ("log.profile_ranks", "zero", "'all' or global ranks"),
        ("log.memory_snapshot", "true", "needs log.profile_steps"),
    ],
)
def test_bad_profile_settings_name_the_field(field, value, why):
    with pytest.raises(ConfigError, match=f"{field}=.*{why}"):
        load_config(overrides=["data.path=unused", f"{field}={value}"])
