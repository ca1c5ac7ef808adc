"""``data.eval_sets``: labelled validation sets, each evaluated beside data.path's and logged as
``val/<label>/loss`` (a curve of its own in TensorBoard and a field of metrics.jsonl); a set
of another tokenizer is refused naming it."""

from __future__ import annotations

import json

import pytest

from t2train.config.loader import load_config
from t2train.config.schema import ConfigError

WORDS = "the king queen lord lady castle night day sword crown love war peace heart".split()
TINY = [
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.warmup_steps=1",
    "train.eval_batches=1",
    "log.diagnostics_interval=0",
]


@pytest.fixture(scope="module")
def labelled_sets(shakespeare, tmp_path_factory):
    """Two small datasets of other text with the Shakespeare fixture's tokenizer."""
    from t2train.data.prepare import prepare_dataset

    root = tmp_path_factory.mktemp("eval-sets")
    sets = {}
    for index, label in enumerate(("prose", "verse")):
        text = root / f"{label}.txt"
        text.write_text(_text(seed=index))
        prepare_dataset(
            [str(text)],
            root / label,
            seq_length=32,
            tokenizer=shakespeare / "tokenizer.json",
            val_fraction=0.3,
        )
        sets[label] = root / label
    return sets


@pytest.mark.slow
def test_each_labelled_set_is_a_validation_curve_of_its_own(
    megatron_world, shakespeare, labelled_sets, tmp_path
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from t2train.train.loop import train

    run_dir = tmp_path / "run"
    sets = ",".join(f"{label}={path}" for label, path in labelled_sets.items())
    train(
        load_config(
            overrides=[
                *TINY,
                f"data.path={shakespeare}",
                f"log.run_dir={run_dir}",
                f"data.eval_sets={sets}",
                "train.steps=4",
                "train.eval_interval=2",
            ]
        )
    )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = {record["step"]: record for record in records if "val/loss" in record}
    assert sorted(evaluated) == [0, 2, 4]
    for record in evaluated.values():
        losses = [record["val/loss"], record["val/prose/loss"], record["val/verse/loss"]]
        assert len(set(losses)) == 3 and all(loss > 0 for loss in losses)  # three datasets
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    for tag in ("val/loss", "val/prose/loss", "val/verse/loss"):
        assert [event.step for event in events.Scalars(tag)] == [0, 2, 4], tag


def _text(seed: int) -> str:
    import random

    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choices(WORDS, k=12)) + "." for _ in range(600))


def test_a_set_of_another_tokenizer_or_a_bad_spelling_is_refused(shakespeare, tmp_path):
    from t2train.data.prepare import prepare_dataset
    from t2train.train.inputs import dataset_facts

    (tmp_path / "text.txt").write_text(_text(seed=7))
    prepare_dataset([str(tmp_path / "text.txt")], tmp_path / "other", seq_length=32, vocab_size=300)
    config = load_config(
        overrides=[*TINY, f"data.path={shakespeare}", f"data.eval_sets=mine={tmp_path / 'other'}"]
    )
    with pytest.raises(
        ConfigError,
        match=rf"data.eval_sets: mine={tmp_path / 'other'} was "
        r"prepared with another tokenizer",
    ):
        dataset_facts(config)
    for spelling, why in (("a b=x", "must be LABEL=DIR"), ("a=x,a=y", "each label once")):
        with pytest.raises(ConfigError, match=f"data.eval_sets=.*{why}"):
            load_config(overrides=["data.path=x", f"data.eval_sets={spelling}"])
