"""Known, harmless messages of the libraries t2train builds on, kept off the console.

Each is matched narrowly, by message and by the module that emits it, so a new warning still
shows. ``T2TRAIN_LIBRARY_WARNINGS=1`` shows them all (``silence`` then does nothing).
"""

from __future__ import annotations

import logging
import os
import re
import warnings

# (message regex, module regex, category): Python warnings raised at import or first use.
KNOWN_WARNINGS = (
    # megatron-core falls back to its PyTorch implementations, as it should on CPU and
    # without the optional Transformer Engine / Apex packages.
    (r"Transformer Engine and Apex are not installed", r"megatron\.core", UserWarning),
    (r"Apex is not installed\. Falling back to Torch Norm", r"megatron\.core", UserWarning),
    # megatron-core 0.16's own default (cuda_graph_scope="full") trips its deprecation
    # warning on every TransformerConfig; t2train uses no CUDA graphs.
    (r"full scope is deprecated", r"megatron\.core\.transformer", UserWarning),
)
# logger name -> message regex: library log records.
KNOWN_LOG_RECORDS = {
    # torch probes CUDA_HOME when its C++ extension helper is imported, GPU or not.
    "torch.utils.cpp_extension": r"No CUDA runtime is found",
}


class _DropKnown(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def silence() -> None:
    """Install the filters (idempotent); call before the libraries are imported."""
    if os.environ.get("T2TRAIN_LIBRARY_WARNINGS") == "1":
        return
    for message, module, category in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, pattern in KNOWN_LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(pattern))
