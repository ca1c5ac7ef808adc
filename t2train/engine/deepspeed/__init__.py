"""The DeepSpeed engine: ZeRO stages 1-3 over Megatron-core's model (``engine.py``), its JSON
config generated from t2train's (``config.py``), and its checkpoints read for export
(``export.py``). Importing this package loads nothing: DeepSpeed loads with ``engine.py``."""
