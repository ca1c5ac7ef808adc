"""``train.engine=deepspeed``: DeepSpeed ZeRO on the Megatron-core model (CPU, gloo, 2 ranks).

* DP = 2, same seed and data: ZeRO-1, -2 and -3 match the Megatron engine's losses over 5
  steps within 1e-4 (fp32), for ``standard`` and ``ddl``; TensorBoard tags are the same;
* a fresh process resumes each ZeRO run (``standard``) from its step-3 checkpoint and
  continues with bitwise the losses of the uninterrupted run;
* a run of either engine starts from a checkpoint of either engine at another layout
  (``checkpoint.init_from``: ZeRO-3 at TP = 2 from the Megatron engine, the Megatron engine
  at PP = 2 and ZeRO-1 at TP = 2 from ZeRO-3, ZeRO-2 at TP = 2 from that ZeRO-1 run): its
  step 0 holds the checkpoint's weights exactly, and two runs from one checkpoint at other
  layouts lose alike within 1e-4;
* the generated DeepSpeed config, user JSON overrides and conflicts, and the refusals
  (PP > 1, offload without CUDA, a checkpoint of the other engine or another layout).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from t2train.checkpoint.errors import CheckpointError
from t2train.checkpoint.inspect import describe, resolve_checkpoint
from t2train.checkpoint.store import check_engine
from t2train.config.loader import load_config
from t2train.config.schema import ConfigError
from t2train.engine.deepspeed.config import deepspeed_config

from torchrun_helper import run_torchrun

TOLERANCE = 1e-4
SAVE_AT = 3


def _tags(run_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return set(events.Tags()["scalars"]) | set(events.Tags()["histograms"])


def _forward_ms(run_dir: Path) -> float:
    """The slowest rank's forward time per step at the run's last log step."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if "stragglers/forward_ms_slowest" in r][-1][
        "stragglers/forward_ms_slowest"
    ]


@pytest.mark.slow
def test_zero_stages_match_megatron_and_resume_exactly(shakespeare, tmp_path):
    args = ["--data", str(shakespeare), "--root", str(tmp_path), "--designs", "standard,ddl"]
    straight = run_torchrun(
        "engine_equivalence.py",
        2,
        [*args, "--phase", "straight"],
        tmp_path / "straight.json",
        timeout=900,
    )
    for design, runs in straight.items():
        megatron = runs.pop("megatron")
        assert len(megatron) == 5, design
        for run, losses in runs.items():
            assert losses.keys() == megatron.keys()
            gaps = {step: abs(losses[step] - megatron[step]) for step in megatron}
            assert max(gaps.values()) < TOLERANCE, (design, run, gaps)
            assert _tags(tmp_path / design / run) == _tags(tmp_path / design / "megatron")
            assert _forward_ms(tmp_path / design / run) > 0, run  # the slow-rank report's clock

    checkpoint = tmp_path / "standard" / "zero3" / "checkpoints" / f"step_{SAVE_AT:08d}"
    assert "DeepSpeed ZeRO-3" in describe(checkpoint)
    with pytest.raises(CheckpointError, match="written by train.engine=deepspeed"):
        check_engine(checkpoint, "megatron")

    resumed = run_torchrun(
        "engine_equivalence.py",
        2,
        [*args, "--phase", "resume"],
        tmp_path / "resumed.json",
        timeout=900,
    )
    assert "'zero_stage': 1}, this run is" in resumed.pop("refused")
    for run, losses in resumed["standard"].items():
        tail = {
            step: loss for step, loss in straight["standard"][run].items() if int(step) > SAVE_AT
        }
        assert losses == tail, run  # exact float equality
    started = run_torchrun(
        "engine_equivalence.py",
        2,
        [*args, "--phase", "init"],
        tmp_path / "started.json",
        timeout=900,
    )
    _assert_started_from_the_weights(tmp_path / "ddl", started)
    for log in ("straight.log", "resumed.log", "started.log"):  # DeepSpeed's chatter stays silent
        text = (tmp_path / log).read_text()
        for noise in (
            "all_gather_into_tensor` is deprecated",
            "reduce_scatter_tensor` is deprecated",
            "Setting accelerator to CPU",
            "built successfully",
        ):
            assert noise not in text, (log, noise, text[-3000:])


def _assert_started_from_the_weights(root: Path, started: dict) -> None:
    """Each run's step 0 equals the checkpoint it started from, both read back whole by their
    engines' export readers (so a TP split and its join could agree and still be wrong: the
    losses of a Megatron PP = 2 run and a ZeRO-1 TP = 2 run from one checkpoint rule that out)."""
    from t2train.export.load import load_model, open_checkpoint

    def weights(checkpoint: Path) -> dict:
        model = load_model(open_checkpoint(checkpoint), device="cpu").model
        return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}

    sources = {
        "zero3-tp2-from-megatron": "megatron",
        "megatron-pp2-from-zero3": "zero3",
        "zero1-tp2-from-zero3": "zero3",
        "zero2-tp2-from-zero1-tp2": "zero1-tp2-from-zero3",
        "megatron-vocab96-from-zero3": "zero3",
    }
    assert started.keys() == sources.keys()
    padded = set()
    for run, source in sources.items():
        ours = weights(root / run / "checkpoints" / "step_00000000")
        theirs = weights(resolve_checkpoint(root / source))
        assert ours.keys() == theirs.keys(), run
        for name, mine in ours.items():
            rows = len(theirs[name])
            if mine.shape != theirs[name].shape:  # the vocabulary padded to another multiple
                padded.add((run, name, rows, len(mine)))
                assert not mine[rows:].any(), (run, name)  # the added padding rows are zero
            assert torch.equal(mine[:rows], theirs[name]), (run, name)
    assert padded == {
        ("megatron-vocab96-from-zero3", "embedding.word_embeddings.weight", 1024, 1056)
    }
    pipeline, zero = started["megatron-pp2-from-zero3"], started["zero1-tp2-from-zero3"]
    assert pipeline.keys() == zero.keys() == {"1", "2"}
    assert max(abs(pipeline[step] - zero[step]) for step in pipeline) < TOLERANCE


def _config(*overrides: str):
    return load_config(overrides=["data.path=unused", "train.engine=deepspeed", *overrides])


def test_generated_config_follows_t2train_fields():
    config = _config(
        "train.micro_batch_size=2",
        "train.global_batch_size=16",
        "train.clip_grad=0.5",
        "deepspeed.zero_stage=3",
    )
    ds = deepspeed_config(config, dp_size=2)
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4  # 16 / (2 * 2)
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_param"] == {"device": "none"}
    assert ds["optimizer"]["params"]["lr"] == config.train.lr
    assert "scheduler" not in ds  # Megatron's schedule drives the LR


def test_user_json_adds_fields_and_conflicts_are_named(tmp_path):
    extra = tmp_path / "ds.json"
    extra.write_text(
        json.dumps({"zero_optimization": {"reduce_bucket_size": 1000}, "gradient_clipping": 1.0})
    )
    ds = deepspeed_config(_config(f"deepspeed.config_file={extra}"), dp_size=1)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1000
    assert ds["zero_optimization"]["stage"] == 1

    extra.write_text(
        json.dumps(
            {
                "gradient_clipping": 0.3,
                "zero_optimization": {"stage": 2},
                "scheduler": {"type": "WarmupLR"},
            }
        )
    )
    with pytest.raises(ConfigError) as err:
        deepspeed_config(_config(f"deepspeed.config_file={extra}"), dp_size=1)
    message = str(err.value)
    for named in (
        "gradient_clipping=0.3",
        "train.clip_grad",
        "zero_optimization.stage=2",
        "deepspeed.zero_stage",
        "scheduler",
    ):
        assert named in message, named

    extra.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        deepspeed_config(_config(f"deepspeed.config_file={extra}"), dp_size=1)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (
            ["parallel.pipeline=2", "model.num_layers=4"],
            "parallel.pipeline=2: must be 1 with train.engine=deepspeed",
        ),
        (["parallel.tensor=2", "parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
        (["parallel.distributed_optimizer=true"], "parallel.distributed_optimizer"),
        (["checkpoint.async_save=true"], "checkpoint.async_save"),
        (
            ["deepspeed.offload_params=true"],
            "deepspeed.offload_params=True: needs deepspeed.zero_stage=3",
        ),
        (["deepspeed.zero_stage=0"], "deepspeed.zero_stage=0: must be 1, 2 or 3"),
    ],
)
def test_unsupported_layouts_are_refused(overrides, named):
    with pytest.raises(ConfigError) as err:
        _config(*overrides)
    assert named in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="offloading is allowed with CUDA")
def test_offload_without_cuda_is_refused():
    with pytest.raises(ConfigError, match="deepspeed.offload_optimizer=true: offloading"):
        deepspeed_config(_config("deepspeed.offload_optimizer=true"), dp_size=1)
