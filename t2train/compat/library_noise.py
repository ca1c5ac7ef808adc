"""Known, harmless messages of the libraries t2train builds on, kept off the console.

Each is matched narrowly, by message and by the module that emits it, so a new warning still
shows. ``T2TRAIN_LIBRARY_WARNINGS=1`` shows them all (``silence`` then does nothing).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import warnings
from typing import Iterator

# (message regex, module regex, category): Python warnings raised at import or first use; a
# message regex matches from the message's start, as ``warnings.filterwarnings`` does.
KNOWN_WARNINGS = (
    # megatron-core falls back to its PyTorch implementations, as it should on CPU and
    # without the optional Transformer Engine / Apex packages.
    (r"Transformer Engine and Apex are not installed", r"megatron\.core", UserWarning),
    (r"Apex is not installed\. Falling back to Torch Norm", r"megatron\.core", UserWarning),
    # megatron-core 0.16's own default (cuda_graph_scope="full") trips its deprecation
    # warning on every TransformerConfig; t2train uses no CUDA graphs.
    (r"full scope is deprecated", r"megatron\.core\.transformer", UserWarning),
    # Deprecations between megatron-core 0.16's dist-checkpointing and torch DCP, on every
    # checkpoint load: theirs to migrate, nothing a user can change.
    (
        r"`load_state_dict` is deprecated and will be removed in future versions",
        r"megatron\.core\.dist_checkpointing",
        FutureWarning,
    ),
    (
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        r"torch\.distributed\.checkpoint",
        FutureWarning,
    ),
    # DeepSpeed's ZeRO calls the torch collectives torch has deprecated (ZeRO-3: every step).
    (
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        r"torch\.distributed",
        FutureWarning,
    ),
)
# Advice for CUDA runs, noise without CUDA: silenced by ``silence_without_cuda`` (the
# megatron-core CPU shim calls it), so a GPU run still shows it.
CUDA_ADVICE_WARNINGS = (
    # megatron-core with sequence parallelism or tensor-parallel gradient all-reduces, about
    # CUDA streams.
    (
        r"When using (sequence parallelism|async grad allreduce) it is recommended to set the "
        r"environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1",
        r"megatron\.core\.tensor_parallel",
        UserWarning,
    ),
)
# logger name -> message regex: library log records.
KNOWN_LOG_RECORDS = {
    # torch probes CUDA_HOME when its C++ extension helper is imported, GPU or not.
    "torch.utils.cpp_extension": r"No CUDA runtime is found",
    # DeepSpeed on a machine without a GPU picks its CPU accelerator, as it should.
    "DeepSpeed": r"Setting accelerator to CPU\. If you have GPU",
    # torchrun sets OMP_NUM_THREADS=1 for its workers when unset; t2train launch says so once.
    "torch.distributed.run": r"Setting OMP_NUM_THREADS environment variable for each process",
    # torch 2.11 writes dynamo's config as JSON into each compile's metrics and fails on the
    # function t2train adds to ``ignore_logging_functions`` (``nn/compiling.py``), logging a
    # traceback per compile; torch 2.14 leaves that set out. Only the metrics are lost.
    "torch._dynamo.metrics_context": r"Unexpected exception logging compilation metrics",
    # model.recompute=selective in a compiled layer (t2train/nn/recompute.py) passes its policy
    # as checkpoint's context_fn by design; torch then advises, once, against in-place ops in
    # the region (the tests hold the gradients to no recompute's).
    "torch._higher_order_ops.wrap": r"Detected that context_fn is passed to torch\.utils\.",
    # torchao 0.18 (train.precision=fp8) registers its enums with torch's pytree at import,
    # which torch 2.14 supports natively and deprecates, once per enum.
    "torch.utils._pytree": r"is an Enum subclass and is now natively supported by torch\.compile",
}

# Lines libraries print (not log) on stdout: dropped inside ``known_prints_dropped``.
KNOWN_PRINTS = (
    # DeepSpeed's CPU accelerator builds (or loads) its shared-memory op at initialisation.
    r"DeepSpeed deepspeed\.ops\.comm\.\w+ built successfully",
)


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
    _ignore(KNOWN_WARNINGS)
    for name, pattern in KNOWN_LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(pattern))


def silence_without_cuda() -> None:
    """Also drop the CUDA advice (``CUDA_ADVICE_WARNINGS``): for processes without CUDA."""
    if os.environ.get("T2TRAIN_LIBRARY_WARNINGS") != "1":
        _ignore(CUDA_ADVICE_WARNINGS)


def profiler_quiet_without_cuda() -> None:
    """Keep torch.profiler's backend (Kineto) off the console in a process without CUDA: it
    logs its start and stop and "gpuGetDeviceCount failed" on stderr. Kineto reads
    ``KINETO_LOG_LEVEL`` once, when the process's first profile starts; 6 is above its highest
    level. A level the user set is kept."""
    if os.environ.get("T2TRAIN_LIBRARY_WARNINGS") != "1":
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def _ignore(known) -> None:
    for message, module, category in known:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


class _DroppingLines(io.TextIOBase):
    """A text stream that passes whole lines on to ``target``, except the known ones."""

    def __init__(self, target):
        self.target = target
        self.pattern = re.compile("|".join(f"(?:{known})" for known in KNOWN_PRINTS))
        self.partial = ""

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            if not self.pattern.fullmatch(line):
                self.target.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.target.flush()


@contextlib.contextmanager
def known_prints_dropped() -> Iterator[None]:
    """Inside, ``sys.stdout`` loses the lines of ``KNOWN_PRINTS`` (every other line passes)."""
    if os.environ.get("T2TRAIN_LIBRARY_WARNINGS") == "1":
        yield
        return
    stream = _DroppingLines(sys.stdout)
    try:
        with contextlib.redirect_stdout(stream):
            yield
    finally:
        if stream.partial:
            stream.target.write(stream.partial)


@contextlib.contextmanager
def log_records_dropped(name: str, pattern: str) -> Iterator[None]:
    """Inside, the logger ``name`` drops its records whose message matches ``pattern``."""
    if os.environ.get("T2TRAIN_LIBRARY_WARNINGS") == "1":
        yield
        return
    logger, dropped = logging.getLogger(name), _DropKnown(pattern)
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


@contextlib.contextmanager
def progress_bars_hidden() -> Iterator[None]:
    """Inside, tqdm's bars (lm-eval's, datasets') draw nothing: the command around reports its
    own progress on stderr, and the bars' carriage returns garble it and any log file."""
    if os.environ.get("T2TRAIN_LIBRARY_WARNINGS") == "1":
        yield
        return
    # lm-eval has no switch for its bars: every tqdm (datasets' and tqdm.auto's are subclasses)
    # starts disabled, for this block only.
    from tqdm import std  # noqa: PLC0415 - tqdm comes with the libraries it quiets

    init = std.tqdm.__init__

    def disabled(self, *args, **kwargs):
        kwargs["disable"] = True
        init(self, *args, **kwargs)

    setattr(std.tqdm, "__init__", disabled)
    try:
        yield
    finally:
        setattr(std.tqdm, "__init__", init)
