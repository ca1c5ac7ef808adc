"""The deferred import of optional packages megatron-core imports but t2train's runs do not
use (t2train/compat/deferred_import.py): still deferred after a megatron-core upgrade."""

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
    proc = subprocess.run([sys.executable, "-c", DEFERRED_WANDB], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
