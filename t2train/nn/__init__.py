"""Building blocks shared by the model and the residual designs.

Megatron-compatible layers (RMSNorm under sequence parallelism, causal core attention, the
self-attention and MLP specs) and the diagnostics probe that model code reports through. They
know nothing of residual designs, so designs (``t2train/residual/``) can build on them.
"""
