"""t2train: distributed pretraining of decoder Transformers with pluggable residual streams."""

from t2train.compat import deferred_import, library_noise

library_noise.silence()
deferred_import.defer()
