"""Known library warnings are silenced narrowly: by message and emitting module only."""

from __future__ import annotations

import logging
import warnings

from t2train.compat import library_noise


def _warn_from(module: str, message: str) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        library_noise.silence()
        exec(compile(f"import warnings\nwarnings.warn({message!r}, UserWarning)", module, "exec"),
             {"__name__": module})
    return [str(w.message) for w in caught]


def test_the_known_megatron_warning_is_dropped_and_others_are_kept():
    known = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    assert _warn_from("megatron.core.optimizer", known) == []
    assert _warn_from("megatron.core.optimizer", "something new") == ["something new"]
    assert _warn_from("some.other.library", known) == [known]  # only megatron's
    norm = "Apex is not installed. Falling back to Torch Norm"
    assert _warn_from("megatron.core.models.backends", norm) == []
    scope = "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer."
    assert _warn_from("megatron.core.transformer.transformer_config", scope) == []
    assert _warn_from("megatron.core.transformer.transformer_config", "new") == ["new"]


def test_the_known_torch_log_record_is_dropped_and_others_are_kept(caplog):
    library_noise.silence()
    logger = logging.getLogger("torch.utils.cpp_extension")
    with caplog.at_level(logging.WARNING, logger="torch.utils.cpp_extension"):
        logger.warning("No CUDA runtime is found, using CUDA_HOME='/usr/local'")
        logger.warning("a new problem")
    assert [r.getMessage() for r in caplog.records] == ["a new problem"]
