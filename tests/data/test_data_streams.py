"""Sample ids, datasets mixed by proportion, a remote dataset streamed into a separate local
cache, a local dataset unpacked into a cache elsewhere (data.cache_dir), the trainer's choice
of streams from the config, and the checks that refuse datasets that cannot be mixed."""

from __future__ import annotations

import shutil
from itertools import islice

import pytest
import torch

from t2train.config.loader import load_config
from t2train.config.schema import ConfigError
from t2train.data.index import read_index
from t2train.data.loader import StreamingWorld, TokenBatches
from t2train.data.prepare import DataError, prepare_dataset
from t2train.data.streams import DataStream
from t2train.train.data import train_and_val_streams

from textgen import english_ish

ONE = StreamingWorld(0, 1, 0, 1)


def in_order(path, split="train", seq_length=32):
    """Every sample of a split in stored order: (ids, tokens)."""
    batches = list(
        TokenBatches(path, split, 16, seq_length, ONE, seed=0, shuffle=False, finite=True)
    )
    return (
        torch.cat([b["sample_ids"] for b in batches]),
        torch.cat([b["tokens"] for b in batches]),
    )


def test_sample_ids_name_the_stored_samples(dataset):
    ids, tokens = in_order(dataset)
    assert ids.tolist() == list(range(read_index(dataset)["splits"]["train"]["samples"]))
    shuffled = next(TokenBatches(dataset, "train", 16, 32, ONE, seed=4))
    assert shuffled["sample_ids"].tolist() != list(range(16))
    assert torch.equal(shuffled["tokens"], tokens[shuffled["sample_ids"]])


def test_mixing_proportions_hold_within_two_percent(mix_datasets):
    big, small = mix_datasets
    sizes = [read_index(p)["splits"]["train"]["samples"] for p in (big, small)]
    assert sizes[0] > 3 * sizes[1] and sum(sizes) > 15_000  # 10,000 samples: within an epoch
    batches = TokenBatches(
        [DataStream(big, proportion=0.3), DataStream(small, proportion=0.7)],
        "train",
        100,
        8,
        ONE,
        seed=7,
    )
    ids = torch.cat([b["sample_ids"] for b in islice(batches, 100)])
    assert len(ids) == 10_000
    from_small = (ids >= sizes[0]).double().mean().item()  # ids count big's samples first
    assert abs(from_small - 0.7) < 0.02, from_small
    # The small dataset is up-sampled (its samples repeat), the big one down-sampled.
    small_ids = ids[ids >= sizes[0]]
    assert len(small_ids.unique()) < len(small_ids)
    assert len(ids[ids < sizes[0]].unique()) == (ids < sizes[0]).sum()


def test_remote_dataset_streams_into_a_separate_cache(dataset, tmp_path):
    # Read locally first: that decompresses the val shard inside ``dataset`` itself.
    ids, tokens = in_order(dataset, "val")
    remote_files = sorted(p.relative_to(dataset) for p in dataset.rglob("*"))
    cache = tmp_path / "cache"
    batches = TokenBatches(
        cache, "val", 8, 32, ONE, seed=0, remote=str(dataset), shuffle=False, finite=True
    )
    streamed = list(batches)
    assert torch.equal(torch.cat([b["sample_ids"] for b in streamed]), ids)
    assert torch.equal(torch.cat([b["tokens"] for b in streamed]), tokens)
    assert (cache / "index.json").read_text() == (dataset / "index.json").read_text()
    assert list((cache / "val").glob("shard.*.mds*"))
    assert not (cache / "train").exists()  # only the split that was read
    assert sorted(p.relative_to(dataset) for p in dataset.rglob("*")) == remote_files

    with pytest.raises(
        DataError,
        match=rf"remote dataset file {tmp_path}/nowhere/index.json: "
        r"could not download it into the cache",
    ):
        TokenBatches(
            tmp_path / "cache2", "val", 8, 32, ONE, seed=0, remote=str(tmp_path / "nowhere")
        )


def test_datasets_that_cannot_be_mixed(dataset, mix_datasets, tmp_path):
    big, small = mix_datasets
    with pytest.raises(
        DataError,
        match=r"proportions \[0.5, None\]: give every mixed dataset a "
        r"proportion, or none",
    ):
        TokenBatches([DataStream(big, proportion=0.5), DataStream(small)], "train", 4, 8, ONE, 0)
    with pytest.raises(DataError, match=rf"dataset {small}: proportion=0, must be > 0"):
        TokenBatches(
            [DataStream(big, proportion=1), DataStream(small, proportion=0)], "train", 4, 8, ONE, 0
        )
    with pytest.raises(
        DataError,
        match=rf"seq_length=16: needs samples of 17 tokens, but the "
        rf"samples of {big} have 9 tokens",
    ):
        TokenBatches([DataStream(dataset), DataStream(big)], "train", 4, 16, ONE, seed=0)
    with pytest.raises(DataError, match=r"may appear only once"):
        TokenBatches([DataStream(big), DataStream(big)], "train", 4, 8, ONE, seed=0)

    (tmp_path / "a.txt").write_text(english_ish(seed=5, paragraphs=30))
    other = tmp_path / "other"
    prepare_dataset([tmp_path / "a.txt"], other, seq_length=8, vocab_size=300)
    with pytest.raises(
        DataError,
        match=rf"dataset {other}: its tokenizer \(sha256 \w+\) differs "
        rf"from that of {big} .*same tokenizer.json",
    ):
        TokenBatches([DataStream(big), DataStream(other)], "train", 4, 8, ONE, seed=0)


def test_trainer_mixes_train_streams_and_evaluates_data_path(dataset, mix_datasets):
    big, small = mix_datasets
    config = load_config(
        "tiny",
        overrides=[
            f"data.path={big}",
            "data.remote=s3://bucket/big",
            f"data.mix={big}=3,{small}=1",
            f"data.eval_sets=big={big},small={small}",
        ],
    )
    train, val, labelled = train_and_val_streams(config.data)
    assert train == [
        DataStream(str(big), "s3://bucket/big", 3.0),
        DataStream(str(small), None, 1.0),
    ]
    assert val == [DataStream(str(big), "s3://bucket/big")]
    assert labelled == {
        "big": DataStream(str(big), "s3://bucket/big"),
        "small": DataStream(str(small)),
    }

    plain = load_config("tiny", overrides=[f"data.path={dataset}"])
    assert train_and_val_streams(plain.data) == ([DataStream(str(dataset))],) * 2 + ({},)


def test_cache_dir_keeps_unpacked_shards_out_of_the_dataset(dataset, tmp_path):
    """With data.cache_dir the dataset directory is only read (it could be read-only): the
    unpacked .mds files go into a folder per dataset version in the cache, without the
    compressed copies, and the samples are those of the dataset itself."""
    source = tmp_path / "ds"
    shutil.copytree(dataset, source, ignore=shutil.ignore_patterns("*.mds"))
    before = sorted(p.relative_to(source) for p in source.rglob("*"))
    config = load_config(
        "tiny", overrides=[f"data.path={source}", f"data.cache_dir={tmp_path / 'scratch'}"]
    )
    train, val, _ = train_and_val_streams(config.data)
    read = [
        torch.cat(
            [
                b["tokens"]
                for b in TokenBatches(
                    streams, split, 16, 32, ONE, seed=0, shuffle=False, finite=True
                )
            ]
        )
        for streams, split in ((train, "train"), (val, "val"))
    ]
    assert torch.equal(read[0], in_order(dataset, "train")[1])
    assert torch.equal(read[1], in_order(dataset, "val")[1])
    assert sorted(p.relative_to(source) for p in source.rglob("*")) == before
    cached = sorted(
        p.relative_to(tmp_path / "scratch") for p in (tmp_path / "scratch").rglob("shard.*")
    )
    version = train[0].path.name
    assert version.startswith("ds-") and [str(p) for p in cached] == [
        f"{version}/train/shard.00000.mds",
        f"{version}/val/shard.00000.mds",
    ]

    index = source / "index.json"  # the dataset prepared again: a new cache folder
    index.write_text(index.read_text().replace('"seed": 0', '"seed": 1'))
    assert train_and_val_streams(config.data)[0][0].path.name != version
    with pytest.raises(
        ConfigError,
        match=r"data.cache_dir=.*: cannot be combined with "
        r"data.remote",
    ):
        load_config(
            "tiny",
            overrides=[
                f"data.path={source}",
                "data.remote=s3://b/ds",
                f"data.cache_dir={tmp_path}",
            ],
        )
