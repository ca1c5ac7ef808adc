"""t2train.data: corpus preparation into MDS shards and deterministic streaming loaders."""
