"""The deferred imports of t2train/compat/deferred_import.py: what megatron-core and
mosaicml-streaming load at import but t2train's runs do not use (W&B, streaming's datasets,
Inductor), still deferred after an upgrade, and still working once used."""

import subprocess
import sys

import pytest

DEFERRED_WANDB = """
import sys
import t2train
import megatron.core.timers as timers
from megatron.core.inference.contexts import dynamic_context
from t2train.compat.deferred_import import DeferredModule
assert isinstance(sys.modules["wandb"], DeferredModule), sys.modules["wandb"]
assert dynamic_context.HAVE_WANDB and timers.wandb is sys.modules["wandb"]
loaded = sorted(name for name in sys.modules if name.startswith("wandb."))
assert not loaded, f"importing megatron.core loaded {loaded[:5]}: re-check deferred_import.py"
import wandb
assert callable(wandb.init) and "wandb.sdk" in sys.modules
assert timers.wandb.init is sys.modules["wandb"].init  # megatron's name reaches the package
"""


def test_megatron_core_imports_wandb_without_loading_it():
    """With t2train[wandb] installed megatron.core's module-level ``import wandb`` cost 2.8 s
    of every process's start; deferred, W&B loads at its first real use."""
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install 't2train[wandb]'")
    proc = subprocess.run(
        [sys.executable, "-c", DEFERRED_WANDB], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


DEFERRED_AT_START = """
import sys
import t2train.train.trainer  # megatron.core and streaming, as every rank imports them
import streaming
from megatron.core import jit
from megatron.core.fusions import fused_bias_geglu
from t2train.compat.deferred_import import DeferredModule, compile_at_first_call
for name in ("streaming.multimodal", "streaming.text", "streaming.vision"):
    assert isinstance(sys.modules[name], DeferredModule), (name, sys.modules[name])
import t2train.data.loader  # streaming's StreamingDataLoader, as every rank imports it
loaded = [
    name for name in ("torch._inductor.compile_fx", "torchvision", "transformers")
    if name in sys.modules
]
assert not loaded, f"importing the trainer loaded {loaded}: re-check deferred_import.py"
assert jit.jit_fuser is compile_at_first_call, jit.jit_fuser
assert streaming.vision.StreamingCIFAR10.__module__ == "streaming.vision.cifar10"  # loads on use
assert streaming.StreamingDataLoader([])._get_batch_size({"tokens": [[1], [2], [3]]}) == 3
from transformers.tokenization_utils_base import BatchEncoding  # the real one, on first use
assert BatchEncoding.__module__ == "transformers.tokenization_utils_base"
assert hasattr(BatchEncoding, "char_to_token"), BatchEncoding
import torch
y = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
a, b = y.chunk(2, -1)
formula = a * 0.5 * (1 + torch.tanh(0.79788456 * a * (1 + 0.044715 * a * a))) * b
# Inside a compiled caller it is traced into the caller's graph (fullgraph: no break) ...
traced = torch.compile(lambda t: fused_bias_geglu.geglu(t) * 2, fullgraph=True,
                       backend="aot_eager")(y)
torch.testing.assert_close(traced, 2 * formula)
assert "torch._inductor.compile_fx" not in sys.modules
# ... and called alone it is given to torch.compile at its first call, once.
compiled = []
torch.compile = lambda fn, **options: compiled.append(fn) or fn  # records, compiles nothing
for _ in range(2):
    torch.testing.assert_close(fused_bias_geglu.geglu(y), formula)
assert compiled == [fused_bias_geglu.geglu.__wrapped__], compiled
"""


def test_streaming_datasets_and_megatron_fusions_compile_at_first_use():
    """streaming's text, vision and multimodal datasets (torchvision), the transformers
    classes its data loader imports, and megatron-core's ``torch.compile``-decorated fusions
    (Inductor) cost about 2 s of every process's start; deferred, they load at first use and
    compute the same."""
    proc = subprocess.run(
        [sys.executable, "-c", DEFERRED_AT_START], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_streaming_loader_imports_from_transformers_what_the_stand_ins_replace():
    """An upgrade of mosaicml-streaming that imports more of transformers in its data loader
    (or none) must revisit ``STREAMING_LOADER_IMPORTS``."""
    import ast
    import importlib.util

    from t2train.compat.deferred_import import STREAMING_LOADER, STREAMING_LOADER_IMPORTS

    tree = ast.parse(open(importlib.util.find_spec(STREAMING_LOADER).origin).read())
    imported = {
        node.module: ",".join(alias.name for alias in node.names)
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers")
    }
    assert imported == STREAMING_LOADER_IMPORTS
